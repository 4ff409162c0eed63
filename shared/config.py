"""Frozen, validated configuration built once at start-up and passed explicitly."""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shared.errors import PacerError

# The token budget, chosen by bench/budget_sweep.py
# (docs/benchmarks.md#choosing-the-token-budget): serving keeps decode gaps short, offline
# generation (no one waits between tokens) takes the larger budget's throughput — as vLLM
# picks its default by usage context.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DEFAULT_OFFLINE_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_BLOCK_SIZE = 16
# The largest KV block a flag takes, in tokens: far past any kernel's (flash-attn's 256) and
# any sensible one. A block of 10**20 tokens was "--kv-cache-memory holds no KV block of
# 5.2e25 bytes", naming the flag that was right.
MAX_BLOCK_SIZE = 2**16
DEFAULT_KV_CACHE_MEMORY = "2GiB"
# `--target-tbt-ms auto`: an iteration that carries prefill may take this many times the
# predicted time of its decodes alone, and at least that of its decodes plus the few prefill
# rows a prompt may always take (where the GEMMs widen their weights from some row count: one
# fewer times the decodes plus a block) (docs/design.md#the-token-gap-target;
# docs/benchmarks.md#one-call-for-mixed-iterations measures it)
AUTO_TBT_FACTOR = 1.5
AUTO_TBT_TEXT = (f"{AUTO_TBT_FACTOR:g}x the predicted decodes, at least the decodes plus a few "
                 f"prompt rows ({AUTO_TBT_FACTOR - 1:g}x the decodes plus a block where the "
                 f"GEMMs widen their weights), longer while prompts fall behind a TTFT goal")
# `--target-ttft-ms auto` (P/D prefill instances): a prompt's first token within this many
# times its own predicted prefill, plus one full-budget iteration (docs/design.md#the-ttft-goal)
AUTO_TTFT_FACTOR = 3.0

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; plain ints are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise PacerError(f"cannot read memory size {text!r} (use e.g. 2GiB, 512MiB, 1GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class IterationCostModel(Protocol):
    """What the latency budget asks of a cost model (`shared.cost_model` has the
    roofline one). Chunks are `(q_rows, kv_len)`: a decode at context L is `(1, L)`."""

    def max_prefill_rows(self, budget_ms: float, chunks: Sequence[tuple[int, int]],
                         prefix_len: int) -> int:
        """The most rows of a prefill chunk over a cached prefix of `prefix_len` that keep the
        iteration `chunks + [that chunk]` within `budget_ms`; 0 if not even one row does."""

    def iteration_ms(self, chunks: Sequence[tuple[int, int]]) -> float:
        """The predicted wall time of one forward over `chunks`."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS   # the token budget
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    num_kv_blocks: int = 1024
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # Automatic prefix caching (docs/design.md#prefix-caching): full blocks of computed K/V
    # are kept, indexed by a hash of the prefix they end, and reused by later requests.
    enable_prefix_caching: bool = True
    # The latency budget (docs/design.md#the-latency-budget): prefill rides along with the
    # decodes only as far as `iteration_cost` says fits in this many ms. None: the token
    # budget alone.
    max_iteration_ms: float | None = None
    # The token-gap target (docs/design.md#the-token-gap-target): while decodes run, prefill
    # rides along only as far as keeps the iteration within `target_tbt_ms`, or within
    # `target_tbt_factor` x the predicted decodes, at least the decodes plus the rows a
    # prompt may always take (`--target-tbt-ms auto`; scheduler_svc/core/scheduler.py).
    # With no decode running, prefill takes the whole token budget.
    target_tbt_ms: float | None = None
    target_tbt_factor: float | None = None
    # The TTFT goal of a P/D prefill instance (docs/design.md#the-ttft-goal): prompts ordered
    # by deadline, iterations sized so that each placed prompt still meets its goal, attainment
    # counted. A goal of `target_ttft_ms`, or `target_ttft_factor` x the prompt's own predicted
    # prefill (`--target-ttft-ms auto`); both None: first come, first served.
    target_ttft_ms: float | None = None
    target_ttft_factor: float | None = None
    iteration_cost: IterationCostModel | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "block_size",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise PacerError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        ms = self.max_iteration_ms
        if ms is not None:
            if not (isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0):
                raise PacerError(f"--max-iteration-ms must be a positive number, got {ms!r}")
        if self.target_ttft_ms is not None and self.target_ttft_factor is not None:
            raise PacerError("a TTFT goal is target_ttft_ms or target_ttft_factor, not both")
        for name in ("max_iteration_ms", "target_tbt_ms", "target_tbt_factor", "target_ttft_ms",
                     "target_ttft_factor"):
            if getattr(self, name) is not None and self.iteration_cost is None:
                raise PacerError(f"{name} needs a cost model (iteration_cost)")


def shown_count(value: int) -> str:
    """An integer a flag was given, for its error: 1,024, or "a 21-digit number" for a typo."""
    return f"{value:,}" if abs(value) < 10**15 else f"a {len(str(abs(value)))}-digit number"


def check_block_size(block_size: int) -> int:
    """`block_size` unless it is below 1 or over MAX_BLOCK_SIZE, then a one-line error."""
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise PacerError(f"--block-size must be from 1 to {MAX_BLOCK_SIZE:,} tokens, got "
                         f"{shown_count(block_size)}")
    return block_size


def num_blocks_for_memory(memory: str | int, block_bytes: int) -> int:
    try:
        n = parse_size(memory) // block_bytes
    except PacerError as e:
        raise PacerError(f"--kv-cache-memory: {e}") from None
    if n < 1:
        raise PacerError(f"--kv-cache-memory {memory} holds no KV block of {block_bytes} bytes")
    return n


def activation_dtype(weight_dtype: str, device: str) -> str:
    """The residual stream's dtype: float32 on CPU whatever the weights are, since torch's
    bfloat16 pointwise and attention kernels there are slower than float32 ones."""
    return "float32" if device == "cpu" else weight_dtype


def kv_cache_dtype(weight_dtype: str, device: str, quantization: str = "none") -> str:
    """The KV cache's dtype: the weights' — a bfloat16 cache halves the bytes a CPU decode
    reads (the decode kernels widen it to float32) — except float16 on CPU (which the engine
    refuses; float32 for any other caller); and bfloat16 on CPU under quantized weights (`quantization` int8/int4) whatever the dtype,
    where the weights' rounding already dwarfs the cache's and a float32 cache doubles what
    attention reads (docs/benchmarks.md#a-bfloat16-kv-cache-under-quantized-weights)."""
    if device == "cpu" and quantization in ("int8", "int4"):
        return "bfloat16"
    if device == "cpu" and weight_dtype not in ("float32", "bfloat16"):
        return "float32"
    return weight_dtype
