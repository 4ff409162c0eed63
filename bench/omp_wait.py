"""Why `shared/__init__.py` sets OMP_WAIT_POLICY=PASSIVE: the same torch ops with spinning
(ACTIVE) and sleeping (PASSIVE) OpenMP waits, each in a fresh process, while another process
keeps one core busy — as the gateway, scheduler, Redis or a second rank do beside a worker.

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


def probe(policy: str, threads: int) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    out = subprocess.run([sys.executable, "-c", PROBE.replace("THREADS", str(threads))],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        rows = []
        for _ in range(args.rounds):                     # A, B, A, B
            for policy in ("ACTIVE", "PASSIVE"):
                rows.append({"policy": policy, **probe(policy, args.threads)})
    finally:
        busy.kill()
    print(f"torch threads {args.threads}, one other process spinning on a core (microseconds):")
    print(f"{'policy':8s} {'pointwise':>10s} {'gemm 64 rows':>13s} {'gemm 512 rows':>14s}")
    for r in rows:
        print(f"{r['policy']:8s} {r['pointwise_us']:10.0f} {r['gemm_64_rows_us']:13.0f} {r['gemm_512_rows_us']:14.0f}")


if __name__ == "__main__":
    main()
