"""Why `shared/__init__.py` bounds OpenMP's spinning: the same torch ops with unbounded
spinning (ACTIVE), sleeping (PASSIVE) and a bounded spin (the default), each in a fresh
process, while other processes keep cores busy — as the gateway, scheduler, Redis or a
second rank do beside a worker.

    python bench/omp_wait.py [--threads 2] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROBE = r'''
import json, time, torch
torch.set_num_threads(THREADS)
x = torch.randn(512, 576)
w = torch.randn(1536, 576).to(torch.bfloat16)
def t(f, reps=50):
    f(); s = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - s) / reps * 1e6
print(json.dumps({"pointwise_us": t(lambda: x * x), "gemm_64_rows_us": t(lambda: x[:64].to(torch.bfloat16) @ w.T),
                  "gemm_512_rows_us": t(lambda: x.to(torch.bfloat16) @ w.T, 10)}))
'''


POLICIES = {                      # name -> environment
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "SPIN-20k": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "20000"},
}


def probe(policy: str, threads: int) -> dict:
    env = {**os.environ, **POLICIES[policy]}
    out = subprocess.run([sys.executable, "-c", PROBE.replace("THREADS", str(threads))],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", type=int, default=1, help="processes spinning beside the probe")
    args = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        rows = []
        for _ in range(args.rounds):                     # A, B, A, B
            for policy in POLICIES:
                rows.append({"policy": policy, **probe(policy, args.threads)})
    finally:
        for b in busy:
            b.kill()
    print(f"torch threads {args.threads}, {args.busy} other process(es) spinning (microseconds):")
    print(f"{'policy':8s} {'pointwise':>10s} {'gemm 64 rows':>13s} {'gemm 512 rows':>14s}")
    for r in rows:
        print(f"{r['policy']:8s} {r['pointwise_us']:10.0f} {r['gemm_64_rows_us']:13.0f} {r['gemm_512_rows_us']:14.0f}")


if __name__ == "__main__":
    main()
