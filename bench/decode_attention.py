"""Decode attention over the paged KV pool on CPU: one step's worth of it, alone.

`--batch` requests, each one query row against `--context` cached keys, for every layer of the
default model's shape (9 query heads, 3 KV heads, head_dim 64, 30 layers, each layer its own
bfloat16 K/V pool, blocks of 16 scattered over the pool as the allocator leaves them). Best of
10 passes, ms, and the K/V bytes read per second; then the same with one layer's pool read 30
times (in cache), which separates the kernel's arithmetic from its wait on memory.

    python bench/decode_attention.py [--batch 32] [--context 180] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import best_ms, write_json  # noqa: E402  (OpenMP policy first)
import torch  # noqa: E402

from gpu_worker.cpu_kernels import cpu_kernels  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=180)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("no CPU kernels here: run `make setup`")
    g = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // BLOCK)
    blocks = args.batch * per_seq + 8
    pools = [tuple(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
                   for _ in range(2)) for _ in range(LAYERS)]
    tables = torch.randperm(args.batch * per_seq, generator=g).view(args.batch, per_seq)
    lens = torch.full((args.batch,), args.context, dtype=torch.long)
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=g)
    out = torch.empty_like(q)

    def step(layers):
        for k, v in layers:
            kernels.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM ** -0.5, out)

    mb = args.batch * args.context * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS / 1e6
    step(pools)                          # warm-up
    cold = best_ms(lambda: step(pools), 10)
    hot = best_ms(lambda: step([pools[0]] * LAYERS), 10)
    flags = " ".join(f for f in SHOWN_FLAGS if f in cpu_flags())
    print(f"CPU flags: {flags}; torch threads {torch.get_num_threads()}; kernels {kernels.level}")
    print(f"{args.batch} requests x {args.context} keys, {LAYERS} layers, {mb:.0f} MB of K/V: "
          f"{cold:.2f} ms ({mb / cold:.1f} GB/s); one layer's pool {LAYERS} times: {hot:.2f} ms")
    write_json(args.json, {"cpu_flags": flags, "threads": torch.get_num_threads(),
                           "batch": args.batch, "context": args.context, "kv_mb": mb,
                           "ms": cold, "in_cache_ms": hot})


if __name__ == "__main__":
    main()
