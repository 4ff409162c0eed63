"""What `--dtype auto` should pick on a CPU: pacer's offline throughput in float32 and bfloat16,
on this CPU as it is and with its code paths held to AVX2 (torch's ATen kernels, oneDNN and
pacer's own kernels all capped at AVX2, as on a CPU without AVX-512 or native bf16).

Each (machine, dtype) runs in its own process, interleaved, on the same prompts (random
tokens, 64-300 long, 32 new tokens each, greedy). Prints the CPU's flags and a table.

    python bench/dtype_auto.py [--num-prompts 32] [--repeats 1] [--json docs/dtype_auto.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import write_json  # noqa: E402
from shared.cpu import auto_dtype, cpu_flags  # noqa: E402

AS_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "PACER_CPU_ISA": "avx2"}
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")

CHILD = """
import json, random, sys, time
from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.sampling import SamplingParams
n, new, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = random.Random(0)
prompts = [[rng.randint(100, 40000) for _ in range(rng.randint(64, 300))] for _ in range(n)]
engine = LLMEngine(EngineArgs(dtype=dtype), progress=False)
engine.generate(prompts[:4], [SamplingParams(max_tokens=4, temperature=0.0)] * 4)   # warm-up
t = time.perf_counter()
out = engine.generate(prompts, [SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)] * n)
dt = time.perf_counter() - t
from gpu_worker.cpu_kernels import cpu_kernels
kernels = cpu_kernels()
print(json.dumps({"tok_s": sum(len(r.token_ids) for r in out) / dt, "seconds": dt,
                  "kernels": kernels.level if kernels else None}))
"""


def run_one(kind: str, dtype: str, n: int, new: int) -> dict:
    env = {**os.environ, **(AS_AVX2 if kind == "as-avx2" else {})}
    done = subprocess.run([sys.executable, "-c", CHILD, str(n), str(new), dtype], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return {"machine": kind, "dtype": dtype, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    flags = cpu_flags()
    print("CPU flags:", " ".join(f for f in SHOWN_FLAGS if f in flags), "| cores:", os.cpu_count())
    print(f"--dtype auto picks: {auto_dtype('cpu')} here, "
          f"{auto_dtype('cpu', flags - {'avx512_bf16', 'amx_bf16'})} without native bf16")
    rows = []
    for rep in range(args.repeats):
        for kind in ("native", "as-avx2"):
            for dtype in ("float32", "bfloat16"):
                started = time.monotonic()
                rows.append(run_one(kind, dtype, args.num_prompts, args.new_tokens))
                print(f"  [{rep}] {kind:8s} {dtype:9s} {rows[-1]['tok_s']:7.1f} tok/s "
                      f"({time.monotonic() - started:.0f} s wall)", flush=True)
    print("\nmachine   dtype      tok/s (best of repeats)")
    best = {}
    for r in rows:
        key = (r["machine"], r["dtype"])
        best[key] = max(best.get(key, 0.0), r["tok_s"])
    for (kind, dtype), tok_s in best.items():
        print(f"{kind:9s} {dtype:9s} {tok_s:7.1f}")
    for kind in ("native", "as-avx2"):
        ratio = best[(kind, "bfloat16")] / best[(kind, "float32")]
        print(f"{kind}: bfloat16 / float32 = {ratio:.2f}x")
    write_json(args.json, {"cpu_flags": sorted(f for f in SHOWN_FLAGS if f in flags), "rows": rows})


if __name__ == "__main__":
    main()
