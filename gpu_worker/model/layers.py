"""Layers of the decoder, each sharding its own weights for tensor parallelism.

Weights may be stored in a narrower dtype than the activations (bfloat16 weights with a
float32 residual stream on CPU, where bfloat16 GEMMs are twice as fast as float32 ones but
bfloat16 pointwise ops are slower): `_matmul` casts at the edge of each GEMM.

Every parallel layer owns a `load(part, full_tensor)` that copies this rank's slice of a full
checkpoint tensor; `part` names the piece of a fused weight (q/k/v, gate/up). The model's
loader records each (parameter, part) it fills so it can prove every one was loaded once.

Quantized (`quant` = "int4" or "int8", gpu_worker/quant/): a layer holds no float weight (its
`weight` is an empty bfloat16 tensor that only says the GEMMs' input dtype) but `qweight`, a
packed integer matrix. `load` takes a QTensor straight from a GGUF (or quantizes a float
tensor), cuts this rank's rows (column-parallel: whole heads, with their groups' scales) or
columns (row-parallel: on group boundaries, scales cut with them), and packs once every part
of a fused weight has arrived. The vocabulary matrices are int8 per channel under both schemes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.parallel import TPGroup
from gpu_worker.quant import INT4_GROUP
from gpu_worker.quant.linear import Int8Weight, pack
from gpu_worker.quant.tensor import QTensor, cat_rows, to_scheme
from shared.model_config import RopeScaling


def _matmul(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
            packed: torch.Tensor | None = None, qweight=None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ (+ bias) in the weight's dtype, returned in out_dtype (x's dtype unless given);
    through the prepacked copy of W when there is one (see `prepack`), or the quantized one.
    A bias goes into float32's GEMM (F.linear: the same call and bits as transformers'
    nn.Linear) and is added to the product on the other paths."""
    out_dtype = out_dtype or x.dtype
    if qweight is not None:
        y = qweight.mm(x, out_dtype)
    else:
        x_in = x if x.dtype == weight.dtype else x.to(weight.dtype)
        if packed is not None:
            y = _rows_as_in_a_batch(
                x_in, lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
        elif x_in.is_cuda and _gemv_serves(x_in, weight):       # 16-bit operands only
            from gpu_worker.model.triton_gemv import gemv
            y = gemv(x_in, weight)
        elif x_in.dtype == torch.bfloat16 and not x_in.is_cuda:
            y = _rows_as_in_a_batch(x_in, lambda a: F.linear(a, weight))
        elif bias is not None and x_in.dtype == bias.dtype:
            y, bias = F.linear(x_in, weight, bias), None
        else:
            y = F.linear(x_in, weight)
    y = y if y.dtype == out_dtype else y.to(out_dtype)
    return y if bias is None else y.add_(bias.to(y.dtype))


def _rows_as_in_a_batch(x: torch.Tensor, gemm) -> torch.Tensor:
    """oneDNN's bfloat16 GEMM on CPU sums a lone row in another order than the same row among
    two or more (every count from two on agrees, on real activations), so a token's bits, and a
    greedy stream's path, would change with what shares its iteration: a lone row is computed
    as two and the copy dropped (tests/test_cpu_attention_kernels.py)."""
    if x.shape[0] != 1:
        return gemm(x)
    return gemm(x.expand(2, -1).contiguous())[:1]


def _gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    from gpu_worker.model.triton_gemv import serves     # imports Triton: on a GPU only
    return serves(x, weight)


def gpu_16bit(x: torch.Tensor) -> bool:
    """Where the Triton pointwise ops serve (gpu_worker/model/triton_ops.py): 16-bit tensors
    on CUDA; float32 keeps torch's ops (the parity tests' bits)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """W reordered once into oneDNN's blocked layout, or None where that does not apply.

    For bfloat16 weights on CPU, F.linear reorders W on every call; a prepacked copy gives the
    same bits (checked for every batch size in tests/test_cpu_attention_kernels.py) and took a
    64-row GEMM of this model from ~0.39 to ~0.27 ms and the 8-row LM head from 3.5 to 1.7 ms.
    The packed copy replaces the original (`LlamaModel.set_dtypes`), except where the weight is
    tied to the embedding."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    except (AttributeError, RuntimeError):        # a torch build without oneDNN
        return None


def _placeholder() -> nn.Parameter:
    """A quantized layer's `weight`: no values, only the GEMMs' input dtype."""
    return nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)


class ColumnBias(nn.Module):
    """A column-parallel linear's bias (Qwen2's Q, K and V projections), split as its weight
    is: part by part, rank r holding [b_q,r; b_k,r; b_v,r]. Kept in float32 whatever the
    weights' dtype: added in the product's dtype."""

    def __init__(self, local_sizes: list[int], tp: TPGroup):
        super().__init__()
        self.local_sizes, self.tp = local_sizes, tp
        self.weight = nn.Parameter(torch.empty(sum(local_sizes)), requires_grad=False)

    def load(self, part: int, full: torch.Tensor) -> None:
        n, offset = self.local_sizes[part], sum(self.local_sizes[:part])
        self.weight.data[offset:offset + n].copy_(full.narrow(0, self.tp.rank * n, n))


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ (+ b) with W's output rows split across ranks; fused parts are split one by
    one, so rank r holds [q_r; k_r; v_r] and needs no communication
    (docs/design.md#tensor-parallelism)."""

    packed = None        # see prepack()
    qweight = None       # the packed quantized matrix (quant set)

    def __init__(self, in_features: int, part_sizes: list[int], tp: TPGroup,
                 quant: str | None = None, bias: bool = False):
        super().__init__()
        self.local_sizes = [tp.shard(s, "output features") for s in part_sizes]
        self.tp = tp
        self.quant = quant
        self.weight = _placeholder() if quant else nn.Parameter(
            torch.empty(sum(self.local_sizes), in_features), requires_grad=False)
        self.bias = ColumnBias(self.local_sizes, tp) if bias else None
        self.parts = list(range(len(part_sizes)))
        self._pending: dict[int, QTensor] = {}

    def load(self, part: int, full: torch.Tensor | QTensor) -> None:
        n = self.local_sizes[part]
        if self.quant:
            q = to_scheme(full, self.quant, INT4_GROUP)
            self._pending[part] = q.rows(self.tp.rank * n, n)
            if len(self._pending) == len(self.parts):   # every part here: pack them as one
                self.qweight = pack(cat_rows([self._pending.pop(p) for p in self.parts]))
            return
        offset = sum(self.local_sizes[:part])
        self.weight.data[offset:offset + n].copy_(full.narrow(0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return _matmul(x, self.weight, out_dtype, self.packed, self.qweight,
                       None if self.bias is None else self.bias.weight)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_rᵀ): W's input columns split across ranks; one all-reduce."""

    packed = None        # see prepack()
    qweight = None       # the packed quantized matrix (quant set)

    def __init__(self, in_features: int, out_features: int, tp: TPGroup,
                 quant: str | None = None):
        super().__init__()
        self.tp = tp
        self.quant = quant
        self.local_in = tp.shard(in_features, "input features")
        self.weight = _placeholder() if quant else nn.Parameter(
            torch.empty(out_features, self.local_in), requires_grad=False)
        self.parts = [0]

    def load(self, part: int, full: torch.Tensor | QTensor) -> None:
        if self.quant:      # int4: groups never straddle ranks (gpu_worker/quant checks tp)
            q = to_scheme(full, self.quant, INT4_GROUP)
            self.qweight = pack(q.cols(self.tp.rank * self.local_in, self.local_in))
            return
        self.weight.data.copy_(full.narrow(1, self.tp.rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.tp.all_reduce(_matmul(x, self.weight, out_dtype, self.packed, self.qweight))


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r·V/tp, (r+1)·V/tp); ids outside give zeros, and one
    all-reduce sums the ranks' rows into the full embedding."""

    qweight = None       # quantized: an Int8Weight (rows looked up and widened)

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, quant: str | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // tp.size) * tp.size
        self.local_vocab = self.padded_vocab // tp.size
        self.start = tp.rank * self.local_vocab
        self.quant = quant
        self.weight = _placeholder() if quant else nn.Parameter(
            torch.zeros(self.local_vocab, hidden), requires_grad=False)
        self.parts = [0]

    def load(self, part: int, full: torch.Tensor | QTensor) -> None:
        n = max(0, min(self.local_vocab, self.vocab_size - self.start))
        if self.quant:      # int8 per channel under both schemes: rows must be looked up
            q = to_scheme(full, "int8").rows(self.start, n)
            pad = self.local_vocab - n                       # vocabulary padding: zero rows
            self.qweight = Int8Weight(QTensor(
                "int8", torch.cat([q.codes, q.codes.new_zeros(pad, q.shape[1])]),
                torch.cat([q.scale, q.scale.new_ones(pad, 1)]), None, q.group))
            return
        self.weight.data[:n].copy_(full.narrow(0, self.start, n))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.embedding(ids) if self.qweight is not None else F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        x = self._lookup(local.masked_fill(outside, 0))
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h Eᵀ over this rank's vocabulary slice, then gathered to the full vocabulary
    (every rank samples the same token from the same logits)."""

    packed = None        # see prepack()

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: [S, d] -> [S, V]
        if h.is_cuda and self.weight.dtype in (torch.bfloat16, torch.float16):
            local = _mm_float32_out(h.to(self.weight.dtype), self.weight)
        else:
            local = _matmul(h, self.weight, packed=self.packed, qweight=self.qweight)
        logits = self.tp.all_gather_last_dim(local)
        return logits[:, :self.vocab_size]


def _mm_float32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ with 16-bit operands, accumulated and returned in float32 (cuBLAS writes the
    float32 accumulator instead of rounding it to 16 bits): logits keep the precision that
    decides close top-1 calls. A torch without the dtype overload of mm rounds, as F.linear
    does."""
    if _MM_HAS_OUT_DTYPE:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x, weight).float()


_MM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


class RMSNorm(nn.Module):
    """torch's fused RMSNorm: one kernel instead of five pointwise ops (in float32 it gives
    the same bits as transformers' LlamaRMSNorm; the parity tests hold it to that). With
    `fused` set (the CPU kernels, bfloat16 weights) the residual add, the norm and the cast to
    the GEMMs' dtype are one pass."""

    fused = None

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.parts = [0]

    def load(self, part: int, full: torch.Tensor) -> None:
        self.weight.data.copy_(full)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """RMSNorm(x), in out_dtype (x's unless given)."""
        return self.add_(x, None, out_dtype)

    def add_(self, x: torch.Tensor, delta: torch.Tensor | None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x += delta in place (the residual stream), then RMSNorm(x) in out_dtype."""
        out_dtype = out_dtype or x.dtype
        if self.fused is not None and x.dtype == torch.float32 and x.is_contiguous() and \
                (delta is None or delta.is_contiguous()):
            out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
            self.fused.add_rms_norm(x, delta, self.weight, self.eps, out)
            return out
        if delta is not None and gpu_16bit(x) and x.is_contiguous() and delta.is_contiguous():
            from gpu_worker.model import triton_ops
            out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
            return triton_ops.add_rms_norm_(x, delta, self.weight, self.eps, out)
        if delta is not None:
            x.add_(delta)
        y = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return y if y.dtype == out_dtype else y.to(out_dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None
                  ) -> torch.Tensor:
    """RoPE's inverse frequencies, float32, computed as transformers computes them (the same
    operations in the same order, so the same bits): plain, `linear` or `llama3`
    (docs/design.md#model-families-and-rope-scaling)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                .to(torch.float32) / head_dim))
    return inv_freq if scaling is None else scaling.scale(inv_freq, torch.where)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with the checkpoint's theta (and scaling); cos/sin tables precomputed
    in float32. With `fused` set (the CPU kernels, bfloat16 weights) queries and keys rotate
    in place."""

    fused = None

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        # qk: [T, H + KVH, d] (queries and keys rotated together), positions: [T]
        if self.fused is not None and qk.dtype == torch.float32:
            self.fused.rotary_(qk, positions, self.cos, self.sin)
            return qk
        if gpu_16bit(qk) and qk.stride(-1) == 1:
            from gpu_worker.model import triton_ops
            return triton_ops.rope_(qk, positions, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(qk.dtype)
        sin = self.sin[positions].unsqueeze(1).to(qk.dtype)
        return qk * cos + _rotate_half(qk) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
