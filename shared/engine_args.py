"""The engine flags every entry point shares (`pacer generate`, `pacer up`, `pacer scheduler`,
`pacer worker`), parsed once into a frozen value."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace

from shared.cpu import auto_dtype
from shared.config import (DEFAULT_BLOCK_SIZE, DEFAULT_KV_CACHE_MEMORY,
                           DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS)


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    tp: int = 1
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    num_kv_blocks: int | None = None
    kv_cache_memory: str = DEFAULT_KV_CACHE_MEMORY
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_iteration_ms: float | None = None
    hw: str | None = None
    seed: int | None = None

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser,
                     budget: int = DEFAULT_MAX_NUM_BATCHED_TOKENS) -> None:
        p.add_argument("--model", default=None,
                       help="smollm2-135m (default), an HF directory, or a .gguf file")
        p.add_argument("--dtype", default="auto",
                       choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight dtype; auto (default): bfloat16 on CUDA and on CPUs with "
                            "native bf16 (AVX512-BF16/AMX), float32 on other CPUs")
        p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
        p.add_argument("--max-num-batched-tokens", type=int, default=budget,
                       help="token budget: most Q rows in one iteration")
        p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                       help="most requests running at once")
        p.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV blocks per layer (overrides --kv-cache-memory)")
        p.add_argument("--kv-cache-memory", default=DEFAULT_KV_CACHE_MEMORY,
                       help="memory for the KV block pool, e.g. 2GiB")
        p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                       help="tokens per KV block")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the model's)")
        p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false", help="whole prompts in one iteration (ORCA only)")
        p.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                       action="store_false",
                       help="never reuse the K/V of a prefix another request computed")
        p.add_argument("--max-iteration-ms", type=float, default=None,
                       help="latency budget: cut each prefill chunk to what the cost model says "
                            "fits in this many ms beside the decodes (needs --hw)")
        p.add_argument("--hw", default=None,
                       help="hardware profile for --max-iteration-ms: h100, h200, a100, or a JSON "
                            "written by `pacer calibrate`")
        p.add_argument("--seed", type=int, default=None, help="seed for unseeded sampling")

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)
                      if hasattr(args, f.name)}).resolved()

    def resolved(self) -> "EngineArgs":
        """`auto` replaced by the dtype this machine serves fastest in."""
        if self.dtype != "auto":
            return self
        return replace(self, dtype=auto_dtype(self.device))
