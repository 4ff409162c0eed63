"""The engine layout: everything the scheduler and the workers must agree on (the model, the
KV pool's size, the context length, the scheduler's budgets), derived from EngineArgs and the
model files by one function, so the two sides cannot disagree on the KV pool.

Torch-free: the scheduler service sizes its block manager from it without loading torch.
"""
from __future__ import annotations

import re

from dataclasses import dataclass

from shared.config import (AUTO_TBT_FACTOR, AUTO_TTFT_FACTOR, SchedulerConfig, kv_cache_dtype,
                           num_blocks_for_memory)
from shared.cost_model import QUANTIZED_WEIGHT_BYTES, Precision, latency_cost_for, model_shape_of
from shared import gpu_memory
from shared.engine_args import EngineArgs
from shared.errors import PacerError
from shared.model_config import (ModelConfig, check_tp_fits, load_model_config,
                                 quantization_scheme)
from shared.model_source import ModelSource, resolve_model

# Bytes per element of each --dtype, so that the block count is known without importing torch
# (the scheduler service never loads it).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class EngineLayout:
    args: EngineArgs
    source: ModelSource
    model_config: ModelConfig
    max_model_len: int
    scheduler_config: SchedulerConfig

    kv_block_bytes: int         # one block of one rank's KV pool

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler_config.num_kv_blocks

    @property
    def kv_pool_flag(self) -> str:
        """The flag the KV pool was sized by, for errors that ask for another size."""
        return "--num-kv-blocks" if self.args.num_kv_blocks else "--kv-cache-memory"

    def check_pool_holds_context(self) -> None:
        """For serving, as vLLM refuses to start otherwise: a pool that cannot hold one
        sequence of the whole context would refuse, each as it came, every request that may
        run to the context's end (a chat request without max_tokens). In process the caller
        picks each request's max_tokens, and tests run such pools on purpose."""
        pool_tokens = self.num_kv_blocks * self.args.block_size
        if pool_tokens < self.max_model_len:
            raise PacerError(f"the KV pool holds {pool_tokens} tokens ({self.num_kv_blocks} "
                             f"blocks of {self.args.block_size}), fewer than the context of "
                             f"{self.max_model_len}: give --max-model-len {pool_tokens} or "
                             f"less, or more {self.kv_pool_flag}")


def engine_layout(args: EngineArgs) -> EngineLayout:
    """Resolve the model and size the KV pool: `--kv-cache-memory` is per rank, each rank
    holds `num_kv_heads / tp` heads of every block, in the KV cache's dtype (not always the
    weights')."""
    args = args.resolved()
    if args.dtype not in DTYPE_BYTES:
        raise PacerError(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {args.dtype!r}")
    source = resolve_model(args.model, weights=args.load_format != "dummy")
    cfg = load_model_config(source)
    check_tp_fits(cfg, args.tp)       # before anything is spawned or loaded
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise PacerError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        raise PacerError(f"--num-kv-blocks must be >= 1, got {args.num_kv_blocks}")
    quantization = quantization_scheme(args.quantization, source, args.device)
    kv_bytes = DTYPE_BYTES[kv_cache_dtype(args.dtype, args.device, quantization)]
    precision = Precision(DTYPE_BYTES[args.dtype], QUANTIZED_WEIGHT_BYTES.get(quantization),
                          kv_bytes, args.tp)
    block_bytes = precision.kv_block_bytes(model_shape_of(cfg, source.name), args.block_size)
    num_blocks = args.num_kv_blocks or num_blocks_for_memory(_kv_cache_memory(args, cfg),
                                                             block_bytes)
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    if not 2 <= max_model_len <= cfg.max_position_embeddings:
        what = "the model's sliding window: longer contexts are not served" \
            if cfg.sliding_window else "the model's context"
        raise PacerError(f"--max-model-len must be in [2, {cfg.max_position_embeddings}] "
                         f"({what}), got {max_model_len}")
    if args.kv_timeout_s <= 0:
        raise PacerError(f"--kv-timeout-s must be > 0, got {args.kv_timeout_s:g}")
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        num_kv_blocks=num_blocks, block_size=args.block_size,
        max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        max_iteration_ms=args.max_iteration_ms,
        target_tbt_ms=None if args.target_tbt_ms in ("auto", "off") else float(args.target_tbt_ms),
        target_tbt_factor=AUTO_TBT_FACTOR if args.target_tbt_ms == "auto" else None,
        target_ttft_ms=None if args.target_ttft_ms in ("auto", "off") else float(args.target_ttft_ms),
        target_ttft_factor=AUTO_TTFT_FACTOR if args.target_ttft_ms == "auto" else None,
        iteration_cost=latency_cost_for(
            args.max_iteration_ms, args.hw, cfg, precision, args.target_tbt_ms,
            args.target_ttft_ms))
    return EngineLayout(args, source, cfg, max_model_len, scheduler_config, block_bytes)


def _kv_cache_memory(args: EngineArgs, cfg: ModelConfig) -> str | int:
    """--kv-cache-memory, or on CUDA without it what --gpu-memory-utilization leaves
    (shared/gpu_memory.py)."""
    if args.kv_cache_memory is not None or args.num_kv_blocks:
        return args.kv_cache_memory
    dtype_bytes = DTYPE_BYTES[args.dtype]
    return gpu_memory.kv_pool_bytes(
        gpu_memory.cuda_total_memory(args.device), args.gpu_memory_utilization,
        gpu_memory.weight_bytes(cfg, dtype_bytes, args.tp),
        gpu_memory.activation_bytes(cfg, args.max_num_batched_tokens, args.max_num_seqs,
                                    dtype_bytes, args.tp))
