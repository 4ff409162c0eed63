"""Roofline estimate of one iteration's wall time (docs/design.md#the-roofline-cost-model).

An iteration is a list of chunks `(q_rows, kv_len)`: a decode at context L is `(1, L)`, a
prefill chunk of N tokens over a cached prefix S is `(N, S + N)` (docs/design.md#chunks).

    FLOPs = 2 · P_linear · T                     every row through every matmul
          + 4 · d_head · heads · layers · pairs  QKᵀ and PV, per (query, key) pair
    bytes = weights, read once per iteration      the same for 1 row or 10k rows
          + K_tok · kv_len per chunk              each request reads its own cache once
          + K_tok · q_rows per chunk              ...and writes its new rows
    time  = max(FLOPs / peak FLOP/s, bytes / bandwidth)

Refinements over the round numbers of docs/design.md#reference-figures, each small for Llama-2-7B:
- P_linear is counted from the shape, and the LM head runs on one row per chunk (only the
  row that samples reaches it), so a 7B prefill row costs ~13 GFLOPs rather than 2 · 7e9.
- The embedding table is gathered, not read: only the LM head's copy counts as weight bytes
  (with tied embeddings the one table is read once).
- A chunk's causal pairs are exact: q_rows · S + q_rows · (q_rows + 1) / 2.
- Activations between kernels are left out: they matter only at thousands of rows, where
  compute dominates anyway, and the reference figures leave them out too.
- Weights, KV cache and activations can each have their own element size (`weight_bytes`,
  `kv_bytes`, `dtype_bytes`): 4-bit weights beside a 16-bit cache. The activations' size
  picks the matmul rate (quantized weights are widened to it).
- Tensor parallelism (docs/design.md#tensor-parallelism): each of `tp` ranks does 1/tp of the
  FLOPs and reads 1/tp of the KV and of the weights (the norms whole, the vocabulary padded
  to a multiple of tp), and the figures are one rank's. Each
  forward then all-reduces the hidden state 2·layers + 1 times (after attention and after the
  MLP in every layer, and the vocab-parallel embedding), T rows × hidden × `dtype_bytes`
  each; a ring all-reduce moves 2(tp-1)/tp of that through each rank's link, at the
  profile's `interconnect_gb_per_s`. The vocab-parallel LM head then all-gathers each
  sampling row's float32 logits (the vocabulary padded to a multiple of tp, 4 bytes each): a
  ring all-gather moves (tp-1)/tp of them through each rank's link. That time is added to the
  roofline's, not overlapped.
- Small GEMMs run below the sustained rate (docs/design.md#small-chunks-run-below-peak): a
  matmul over M rows runs at `rate · M / (M + r½)`, r½ = the profile's `gemm_half_rows`. The
  layers' GEMMs run over the iteration's T rows, the LM head's over its n sampling rows, so
  the linear compute time is `(2·P_layers·(T + r½) + 2·P_head·(n + r½)) / rate`: the curve
  costs every iteration r½ rows' worth of GEMM time. Attention is left at the full rate (a
  small chunk's attention is priced by its KV bytes).

Two ways to evaluate the model, both here and held to the same answers by the tests:
- `estimate_iteration` / `estimate_groups`: the model as stated, with every term reported
  (`pacer cost`);
- `RooflineCost`: the same sums in closed form, for callers that ask every iteration (the
  scheduler's latency budget, the simulator); "how many prefill rows still fit" is solved as
  a quadratic (attention pairs grow with N²), which the tests hold to a bisection over
  `estimate_iteration`.

Stdlib + `shared` only: the torch-free scheduler core and the engine layout use it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from operator import itemgetter, mul
from typing import Any, Sequence

from shared.errors import PacerError
from shared.fabric import Fabric
from shared.hardware import HardwareProfile, load_hardware
from shared.kv_layout import DIGEST_READ_SHARE
from shared.online_cost import OnlineIterationCost

# One chunk of an iteration as the cost model sees it: (q_rows, kv_len). Not the runner's
# `gpu_worker.attention.Chunk`, which also carries the block table.
ChunkShape = tuple[int, int]
# `count` copies of one chunk, as `pacer cost --decode BxL` gives B decodes: priced in time
# that does not grow with the count, since every term is linear in it.
ChunkGroup = tuple[int, ChunkShape]


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a llama-style decoder (gated MLP, RMSNorm, GQA)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @property
    def layer_matmul_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def params_per_rank(self, tp: int = 1, read: bool = False) -> int:
        """One rank's parameters under tp-way tensor parallelism (docs/design.md#tensor-
        parallelism): the layers' matmuls split tp ways, the vocab-parallel embedding and LM
        head too (the vocabulary padded to a multiple of tp), the norms whole. `read`: only
        what a forward reads, an untied embedding table left out (only T rows are gathered)."""
        tables = 1 if self.tie_word_embeddings or read else 2
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return (self.num_layers * self.layer_matmul_params // tp
                + tables * -(-self.vocab_size // tp) * self.hidden_size + norms)

    @property
    def num_params(self) -> int:
        return self.params_per_rank()

    @property
    def params_read_per_iteration(self) -> int:
        """Every weight except an untied embedding table, of which only T rows are gathered."""
        return self.params_per_rank(read=True)

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """K_tok: one context token's K and V across all layers
        (docs/design.md#the-roofline-cost-model)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """4 · d_head · heads · layers: 2 for q·k and 2 for p·v per head dim."""
        return 4 * self.head_dim * self.num_heads * self.num_layers


MODELS: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape("llama-2-7b", 32, 4096, 11008, 32, 32, 128, 32000),
    "llama-2-13b": ModelShape("llama-2-13b", 40, 5120, 13824, 40, 40, 128, 32000),
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152,
                               tie_word_embeddings=True),
}


def model_shape_of(config: Any, name: str) -> ModelShape:
    """The shape of a served model's `shared.model_config.ModelConfig` (read by attribute
    name, so this module need not import numpy/gguf through it)."""
    fields = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
              "head_dim", "vocab_size", "tie_word_embeddings")
    return ModelShape(name, *(getattr(config, f) for f in fields))


def load_model_shape(spec: str) -> ModelShape:
    """A built-in name (see MODELS), or a model as the workers load it: a .gguf file, a Hugging
    Face model folder or its config.json (read by shared/model_config.py, the one parser of
    both; imported here only then, so that the scheduler's import stays light)."""
    if spec.lower() in MODELS:
        return MODELS[spec.lower()]
    folder = spec
    if os.path.isfile(spec) and not spec.endswith(".gguf"):
        if os.path.basename(spec) != "config.json":
            raise PacerError(f"model {spec!r}: give a .gguf file, a Hugging Face model folder "
                             "or its config.json")
        folder = os.path.dirname(os.path.abspath(spec))
    elif not os.path.exists(spec):
        raise PacerError(f"unknown model {spec!r}: use one of {', '.join(MODELS)}, a .gguf "
                         "file, or a Hugging Face model folder or its config.json")
    from shared.model_config import load_model_config
    from shared.model_source import resolve_model

    source = resolve_model(folder, weights=False)
    return model_shape_of(load_model_config(source), source.name)


@dataclass(frozen=True)
class IterationCost:
    time_ms: float
    flops: float              # the work done, whatever rate it runs at
    bytes: float
    intensity: float          # FLOPs per byte loaded; compare with hw.ridge()
    bound: str                # "compute" | "memory"
    compute_ms: float
    memory_ms: float
    linear_flops: float       # the reference figures' "linear FLOPs" column
    attention_flops: float    # the reference figures' "attention FLOPs" column
    weight_bytes: float
    kv_bytes: float
    num_tokens: int           # Q rows in the iteration
    gemm_efficiency: float = 1.0   # the linear FLOPs' share of the rate, by the GEMMs' rows
    allreduce_ms: float = 0.0      # TP: the forward's all-reduces, added to the roofline's time
    allgather_ms: float = 0.0      # TP: the LM head's logits all-gather, added likewise
    tp: int = 1                    # the FLOPs and bytes above are one rank's of tp


@dataclass
class _Work:
    """FLOPs and bytes summed over chunks, before the weights and the roofline."""

    linear_flops: float = 0.0
    attention_flops: float = 0.0
    kv_bytes: float = 0.0
    num_tokens: int = 0
    num_chunks: int = 0

    def add(self, chunk: ChunkShape, model: ModelShape, kv_tok: float, count: int = 1) -> None:
        """`count` copies of `chunk`."""
        q_rows, kv_len = chunk
        if q_rows < 1 or kv_len < q_rows:
            raise PacerError(f"chunk (q_rows={q_rows}, kv_len={kv_len}) needs 1 <= q_rows <= kv_len")
        prefix = kv_len - q_rows
        pairs = q_rows * prefix + q_rows * (q_rows + 1) / 2
        self.linear_flops += 2.0 * count * (model.num_layers * model.layer_matmul_params * q_rows
                                            + model.lm_head_params)
        self.attention_flops += count * pairs * model.attention_flops_per_pair
        self.kv_bytes += count * (kv_len + q_rows) * kv_tok
        self.num_tokens += count * q_rows
        self.num_chunks += count


# The LM head's logits are float32 whatever the weights are (gpu_worker/model/layers.py).
LOGIT_BYTES = 4

# Bytes per weight of each quantization the workers serve (`--quantization`), their scales
# left out.
QUANTIZED_WEIGHT_BYTES = {"int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class Precision:
    """Element sizes in bytes and the tensor-parallel degree (module docstring): `dtype_bytes`
    the activations' (it picks the matmul rate), `weight_bytes` and `kv_bytes` the weights' and
    the KV cache's (None: as the activations)."""

    dtype_bytes: float = 2
    weight_bytes: float | None = None
    kv_bytes: float | None = None
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("weight_bytes", "kv_bytes"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.dtype_bytes)
        if not (isinstance(self.tp, int) and self.tp >= 1):
            raise PacerError(f"--tp must be an integer >= 1, got {self.tp!r}")

    def kv_per_token(self, model: ModelShape) -> float:
        """One rank's K_tok: its 1/tp of the KV heads."""
        return model.kv_bytes_per_token(self.kv_bytes) / self.tp

    def weights(self, model: ModelShape) -> float:
        """One rank's weight bytes read per iteration."""
        return model.params_per_rank(self.tp, read=True) * self.weight_bytes

    def kv_block_bytes(self, model: ModelShape, block_size: int) -> int:
        """One block of one rank's KV pool: `block_size` tokens' K/V of its KV heads."""
        return int(self.kv_per_token(model) * block_size)

    def allreduce_ms_per_row(self, model: ModelShape, hw: HardwareProfile) -> float:
        """What one Q row adds to a forward's all-reduces on one rank; 0 without TP."""
        row_bytes = (2 * model.num_layers + 1) * model.hidden_size * self.dtype_bytes
        return self._link_ms(row_bytes * 2, hw)

    def allgather_ms_per_chunk(self, model: ModelShape, hw: HardwareProfile) -> float:
        """What one chunk's sampling row adds to the LM head's logits all-gather on one rank
        (float32 logits over the vocabulary padded to a multiple of tp); 0 without TP."""
        padded_vocab = -(-model.vocab_size // self.tp) * self.tp
        return self._link_ms(padded_vocab * LOGIT_BYTES, hw)

    def _link_ms(self, nbytes: float, hw: HardwareProfile) -> float:
        """A ring collective's time on one rank for `nbytes` (all ranks' data; an all-reduce
        passes twice its data): each rank's link carries (tp-1)/tp of it."""
        if self.tp == 1:
            return 0.0
        if hw.interconnect_gb_per_s is None:
            raise PacerError(f"hardware {hw.name!r} states no interconnect_gb_per_s: the "
                             f"all-reduces of --tp {self.tp} cannot be priced")
        return nbytes * (self.tp - 1) / self.tp / (hw.interconnect_gb_per_s * 1e6)


def gemm_idle_flops(model: ModelShape, hw: HardwareProfile) -> float:
    """What the GEMM efficiency curve costs an iteration, in FLOPs at the full rate: r½ rows'
    worth through every layer and through the LM head (module docstring)."""
    return hw.gemm_half_rows * 2.0 * (model.num_layers * model.layer_matmul_params
                                      + model.lm_head_params)


def _precision(dtype_bytes: float | Precision) -> Precision:
    return dtype_bytes if isinstance(dtype_bytes, Precision) else Precision(dtype_bytes)


def _roofline(work: _Work, model: ModelShape, hw: HardwareProfile, p: Precision) -> IterationCost:
    """One rank's share of `work` (all of it without TP) on the roofline, plus its all-reduces."""
    if work.num_chunks == 0:
        raise PacerError("an iteration needs at least one chunk")
    weight_bytes = p.weights(model)
    linear, attention = work.linear_flops / p.tp, work.attention_flops / p.tp
    flops = linear + attention
    total_bytes = weight_bytes + work.kv_bytes
    idle = gemm_idle_flops(model, hw) / p.tp
    compute_ms = (flops + idle) / hw.flops_per_s(p.dtype_bytes) * 1e3
    memory_ms = total_bytes / hw.bytes_per_s * 1e3
    allreduce_ms = work.num_tokens * p.allreduce_ms_per_row(model, hw)
    allgather_ms = work.num_chunks * p.allgather_ms_per_chunk(model, hw)
    return IterationCost(
        time_ms=max(compute_ms, memory_ms) + allreduce_ms + allgather_ms, flops=flops,
        bytes=total_bytes,
        intensity=flops / total_bytes, bound="compute" if compute_ms >= memory_ms else "memory",
        compute_ms=compute_ms, memory_ms=memory_ms, linear_flops=linear,
        attention_flops=attention, weight_bytes=weight_bytes,
        kv_bytes=work.kv_bytes, num_tokens=work.num_tokens,
        gemm_efficiency=linear / (linear + idle), allreduce_ms=allreduce_ms,
        allgather_ms=allgather_ms, tp=p.tp)


def estimate_iteration(chunks: Sequence[ChunkShape], model: ModelShape, hw: HardwareProfile,
                       dtype_bytes: float | Precision = 2) -> IterationCost:
    """The roofline cost of one forward over `chunks` ((q_rows, kv_len) each); `dtype_bytes`
    one element size for everything, or a `Precision`."""
    return estimate_groups([(1, chunk) for chunk in chunks], model, hw, dtype_bytes)


def estimate_groups(groups: Sequence[ChunkGroup], model: ModelShape, hw: HardwareProfile,
                    dtype_bytes: float | Precision = 2) -> IterationCost:
    """`estimate_iteration` over `count` copies of each chunk of `groups` ((count, chunk)
    each), in time that does not grow with the counts."""
    p = _precision(dtype_bytes)
    work, kv_tok = _Work(), p.kv_per_token(model)
    for count, chunk in groups:
        work.add(chunk, model, kv_tok, count)
    return _roofline(work, model, hw, p)


# ---- closed form, for callers that ask every iteration -----------------------------------


_Q, _KV = itemgetter(0), itemgetter(1)


def _sums(chunks: Sequence[ChunkShape]) -> tuple[int, int, float, int]:
    """(Q rows, chunks, causal (query, key) pairs, KV rows read + written)."""
    qs, kvs = list(map(_Q, chunks)), list(map(_KV, chunks))
    rows, kv = sum(qs), sum(kvs)
    # pairs: Σ q·prefix + q(q+1)/2 = Σ q·kv_len - q(q-1)/2, each q(q-1) even (summed in C:
    # the simulator asks this of hundreds of chunks every iteration)
    pairs = sum(map(mul, qs, kvs)) - (sum(map(mul, qs, qs)) - rows) // 2
    return rows, len(chunks), pairs, kv + rows


@dataclass(frozen=True)
class RooflineCost:
    """One model on one machine (`tp` ranks of it): `iteration_ms(chunks)` and
    `max_prefill_rows(...)`. `weight_bytes` and `kv_bytes` default to `dtype_bytes`."""

    model: ModelShape
    hw: HardwareProfile
    dtype_bytes: float = 2
    tp: int = 1
    weight_bytes: float | None = None
    kv_bytes: float | None = None

    def __post_init__(self) -> None:
        m = self.model
        p = Precision(self.dtype_bytes, self.weight_bytes, self.kv_bytes, self.tp)
        tp = p.tp
        # Per-unit costs of one rank, fixed for the model and the machine (frozen: set via
        # object.__setattr__).
        consts = {
            "weight_bytes": p.weight_bytes, "kv_bytes": p.kv_bytes, "precision": p,
            "_row_flops": 2.0 * m.num_layers * m.layer_matmul_params / tp,
            "_chunk_flops": 2.0 * m.lm_head_params / tp,     # the sampling row's LM head
            "_pair_flops": m.attention_flops_per_pair / tp,
            "_idle_flops": gemm_idle_flops(m, self.hw) / tp,  # the GEMM efficiency curve's toll
            "_kv_bytes": p.kv_per_token(m),
            "_weight_bytes": p.weights(m),
            "_flops_per_ms": self.hw.flops_per_s(p.dtype_bytes) / 1e3,
            "_bytes_per_ms": self.hw.bytes_per_s / 1e3,
            "_row_ms": p.allreduce_ms_per_row(m, self.hw),   # TP's all-reduces, per Q row
            "_chunk_ms": p.allgather_ms_per_chunk(m, self.hw),  # its logits gather, per chunk
        }
        for name, value in consts.items():
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, model: ModelShape, hw: HardwareProfile, p: Precision) -> RooflineCost:
        return cls(model, hw, p.dtype_bytes, p.tp, p.weight_bytes, p.kv_bytes)

    def _flops(self, rows: float, chunks: float, pairs: float) -> float:
        """FLOPs at the full rate, the efficiency curve's idle GEMM time included."""
        return (self._row_flops * rows + self._chunk_flops * chunks + self._pair_flops * pairs
                + self._idle_flops)

    def iteration_ms(self, chunks: Sequence[ChunkShape]) -> float:
        """The roofline wall time of one forward over `chunks`, as `estimate_iteration`."""
        rows, n, pairs, kv = _sums(chunks)
        return max(self._flops(rows, n, pairs) / self._flops_per_ms,
                   (self._weight_bytes + self._kv_bytes * kv) / self._bytes_per_ms) \
            + self._row_ms * rows + self._chunk_ms * n

    def kv_digest_ms(self, tokens: int) -> float:
        """P/D: one side's digest of `tokens` tokens' K/V blocks (docs/design.md#kv-integrity),
        memory-bound: it reads DIGEST_READ_SHARE of their bytes (each rank its share, at once)."""
        return tokens * self._kv_bytes * DIGEST_READ_SHARE / self._bytes_per_ms

    def max_prefill_rows(self, budget_ms: float, chunks: Sequence[ChunkShape], prefix_len: int) -> int:
        """Largest N such that `chunks + [(N, prefix_len + N)]` runs within `budget_ms`."""
        rows, n, pairs, kv = _sums(chunks)
        s, r = prefix_len, self._row_ms
        # What the roofline may take: the budget less the all-reduces, (rows + N) · r, and
        # the logits all-gathers of the n + 1 chunks.
        left_ms = budget_ms - r * rows - self._chunk_ms * (n + 1)
        # Memory: weights + K_tok · (kv + S + 2N) <= bandwidth · (left - r·N); linear in N.
        by_bytes = ((self._bytes_per_ms * left_ms - self._weight_bytes) / self._kv_bytes
                    - kv - s) / (2 + self._bytes_per_ms * r / self._kv_bytes)
        # Compute: a·N² + b·N + c <= 0 with the new chunk's N·S + N(N+1)/2 pairs.
        a = self._pair_flops / 2
        b = self._row_flops + self._pair_flops * (s + 0.5) + self._flops_per_ms * r
        c = self._flops(rows, n + 1, pairs) - self._flops_per_ms * left_ms
        by_flops = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a) if c <= 0 else -1.0
        return self._settle(max(0, math.floor(min(by_bytes, by_flops))), budget_ms,
                            (rows, n, pairs, kv), s)

    def _settle(self, guess: int, budget_ms: float, base: tuple[int, int, float, int],
                s: int) -> int:
        """Floating point can put the closed form one row off the exact boundary."""
        def fits(x: int) -> bool:
            rows, n, pairs, kv = base
            flops = self._flops(rows + x, n + 1, pairs + x * s + x * (x + 1) // 2)
            nbytes = self._weight_bytes + self._kv_bytes * (kv + s + 2 * x)
            return max(flops / self._flops_per_ms, nbytes / self._bytes_per_ms) \
                + self._row_ms * (rows + x) + self._chunk_ms * (n + 1) <= budget_ms

        while guess > 0 and not fits(guess):
            guess -= 1
        while fits(guess + 1):
            guess += 1
        return guess


# ---- the KV capacity (docs/design.md#the-memory-wall) -------------------------------------


@dataclass(frozen=True)
class KVCapacity:
    """How many context tokens' K/V one device holds: what `utilization` of its memory leaves
    after the weights, one forward's activations and the CUDA context, as the served system
    sizes its pool on CUDA (shared/gpu_memory.py)."""

    memory_bytes: float
    utilization: float
    weight_bytes: float
    activation_bytes: float
    kv_bytes: float               # the pool
    kv_bytes_per_token: float
    tokens: int                   # context tokens the pool holds, all requests together

    def sequences(self, context_len: int) -> int:
        """How many requests of `context_len` tokens fit at once (the batch the wall allows)."""
        return self.tokens // max(1, context_len)


def kv_capacity(model: ModelShape, hw: HardwareProfile, dtype_bytes: float | Precision = 2,
                utilization: float = 0.9, max_num_batched_tokens: int = 2048,
                max_num_seqs: int = 256, remedy: str | None = None) -> KVCapacity:
    """The KV pool `hw` holds for `model` (one rank's, under TP: its share of the weights,
    and of each token's K/V); PacerError when the profile names no memory or the weights
    leave no room, that one ending in `remedy` (the serving flags' when None)."""
    from shared import gpu_memory

    if hw.memory_bytes is None:
        raise PacerError(f"hardware {hw.name!r} states no memory_gib: give the KV pool's size "
                         "(--kv-cache-memory or --num-kv-blocks)")
    if not 0 < utilization <= 1:
        raise PacerError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    p = _precision(dtype_bytes)
    weights = gpu_memory.weight_bytes(model, p.weight_bytes, p.tp)
    activations = gpu_memory.activation_bytes(model, max_num_batched_tokens, max_num_seqs,
                                              p.dtype_bytes, p.tp)
    pool = gpu_memory.kv_pool_bytes(int(hw.memory_bytes), utilization, int(weights),
                                    int(activations), remedy or gpu_memory.SERVING_REMEDY)
    per_token = p.kv_per_token(model)
    return KVCapacity(hw.memory_bytes, utilization, weights, activations, pool, per_token,
                      int(pool // per_token))


# ---- the P/D hop (docs/design.md#pd-disaggregation-pricing-the-hop) ------------------------


def kv_transfer_bytes(model: ModelShape, prompt_len: int, dtype_bytes: float = 2) -> float:
    """The KV cache a prefill instance hands to a decode instance: L_p · K_tok."""
    return prompt_len * model.kv_bytes_per_token(dtype_bytes)


def exposed_transfer_ms(transfer_ms: float, prefill_ms: float, num_layers: int) -> float:
    """What a transfer adds after the prefill ends, with layer streaming: layer i's K/V leave
    as soon as layer i is computed, i/L of the way through a prefill of `prefill_ms`, and the
    link sends the L pieces of T/L ms each one after another. The last piece leaves at the
    end of the prefill, so at least T/L is exposed; when the link is the slower side, the
    pieces queue and what the prefill could not hide is exposed too:

        exposed = max(T/L, T - P·(L-1)/L) = T/L + max(0, T - P)·(L-1)/L

    Without streaming (num_layers = 1) the whole T is exposed."""
    if num_layers < 1:
        raise PacerError(f"num_layers must be >= 1, got {num_layers}")
    return max(transfer_ms / num_layers, transfer_ms - prefill_ms * (num_layers - 1) / num_layers)


@dataclass(frozen=True)
class TransferCost:
    """One request's hop over one fabric (`pacer cost --transfer`)."""

    model: str
    fabric: str
    gb_per_s: float
    prompt_len: int
    kv_bytes_per_token: float
    kv_bytes: float               # all ranks'
    links: int                    # the TP ranks, each sending its share over a link of its own
    transfer_ms: float            # alone on the fabric, nothing overlapped
    prefill_ms: float             # the prompt prefilled in one iteration, by the roofline
    exposed_ms: float             # what layer streaming behind that prefill leaves exposed
    hiding_gb_per_s: float        # the bandwidth at which the transfer takes the prefill's time


def estimate_transfer(model: ModelShape, prompt_len: int, fabric: Fabric, hw: HardwareProfile,
                      dtype_bytes: float | Precision = 2) -> TransferCost:
    """The hop of a `prompt_len` prompt's KV cache over `fabric`, and how much of it layer
    streaming hides behind the prompt's prefill on `hw`. Under TP each rank holds its heads'
    share and sends it over a link of its own (each GPU its own NIC), the tp links side by
    side."""
    if prompt_len < 1:
        raise PacerError(f"a prompt needs at least 1 token, got {prompt_len}")
    p = _precision(dtype_bytes)
    nbytes = kv_transfer_bytes(model, prompt_len, p.kv_bytes)
    transfer = fabric.transfer_ms(nbytes / p.tp)
    prefill = estimate_iteration([(prompt_len, prompt_len)], model, hw, p).time_ms
    return TransferCost(
        model=model.name, fabric=fabric.name, gb_per_s=fabric.gb_per_s, prompt_len=prompt_len,
        kv_bytes_per_token=model.kv_bytes_per_token(p.kv_bytes), kv_bytes=nbytes, links=p.tp,
        transfer_ms=transfer, prefill_ms=prefill,
        exposed_ms=exposed_transfer_ms(transfer, prefill, model.num_layers),
        hiding_gb_per_s=nbytes / p.tp / prefill / 1e6)


def latency_cost_for(max_iteration_ms: float | None, hw: str | None, model_config: Any,
                     dtype_bytes: float | Precision, target_tbt_ms: str = "off",
                     target_ttft_ms: str = "off"):
    """The cost model behind `--max-iteration-ms`, `--target-tbt-ms` and `--target-ttft-ms`:
    the roofline of `--hw` when one is named (one rank's, `dtype_bytes` a `Precision` that
    names the weights' and the cache's element sizes and --tp), else the model fitted online
    from measured forward times (shared/online_cost.py); None when no budget or goal is asked
    for."""
    if max_iteration_ms is None and target_tbt_ms == "off" and target_ttft_ms == "off":
        return None
    if hw is None:
        return OnlineIterationCost()
    return RooflineCost.of(model_shape_of(model_config, "served model"), load_hardware(hw),
                           _precision(dtype_bytes))
