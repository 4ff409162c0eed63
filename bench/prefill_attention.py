"""The CPU prefill attention kernel alone (csrc/paged_prefill.cpp, docs/design.md#prefill-attention-on-cpu):
chunks of a few rows over a long cached prefix (what the token-gap target cuts a long prompt
into while decodes run) and the 512-row chunks of a 1,500-token prompt alone, on the default
model's attention shape (9 query heads, 3 KV heads, head_dim 64), random K/V in a paged cache.

Prints per shape the ms per layer, the 30 layers' total and the GFLOP/s of the scores and the
weighted sum (4 flops per query head, key and dimension), and the whole 1,500-token prompt's
attention.

    python bench/prefill_attention.py [--cache-dtype bfloat16|float32] [--reps 30]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from gpu_worker.cpu_kernels import cpu_kernels  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
SHAPES = [(2, 1100), (13, 1100), (22, 1000), (32, 1100), (64, 1100), (128, 0), (512, 0)]
PROMPT = [(512, 0), (512, 512), (476, 1024)]          # a 1,500-token prompt in 512-row chunks


def time_chunk(kernels, k_cache, v_cache, rows: int, prefix: int, reps: int) -> float:
    """Mean ms of one call over `reps` after three warm-up calls."""
    kv = prefix + rows
    blocks = -(-kv // BLOCK)
    table = torch.randperm(k_cache.shape[0])[:blocks].to(torch.int32).view(1, blocks)
    q = torch.randn(rows, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    cu = torch.tensor([0, rows], dtype=torch.int32)
    lens = torch.tensor([kv], dtype=torch.int32)

    def call():
        kernels.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, 1,
                                        HEAD_DIM ** -0.5, out)
    for _ in range(3):
        call()
    t = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None or not kernels.paged_prefill_supported(HEAD_DIM, HEADS // KV_HEADS):
        sys.exit("this build has no prefill attention kernel (an AVX2 or AVX-512 build)")
    dtype = getattr(torch, args.cache_dtype)
    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(256, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
    rows = []
    for part, (q_rows, prefix) in [("chunk", s) for s in SHAPES] + [("prompt", s) for s in PROMPT]:
        reps = max(3, args.reps * 32 // max(32, q_rows))
        ms = time_chunk(kernels, k_cache, v_cache, q_rows, prefix, reps)
        pairs = q_rows * prefix + q_rows * (q_rows + 1) // 2
        rows.append({"part": part, "rows": q_rows, "prefix": prefix, "ms_per_layer": round(ms, 3),
                     "ms_30_layers": round(ms * LAYERS, 1),
                     "gflop_s": round(4 * pairs * HEADS * HEAD_DIM / ms / 1e6, 1)})
    flags = sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"kernels {kernels.level}, {torch.get_num_threads()} threads, {args.cache_dtype} cache, "
          f"CPU flags {' '.join(flags)}")
    print_table(rows, list(rows[0]))
    prompt = sum(r["ms_30_layers"] for r in rows[len(SHAPES):])
    print(f"a 1,500-token prompt's attention (512-row chunks, {LAYERS} layers): {prompt:.0f} ms")
    write_json(args.json, {"rows": rows, "prompt_ms": prompt, "level": kernels.level,
                           "cache_dtype": args.cache_dtype, "cpu_flags": flags})


if __name__ == "__main__":
    main()
