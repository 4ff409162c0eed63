"""Fused pointwise ops for 16-bit activations on a GPU, in Triton (docs/gpu.md#fused-ops).

A decode step of a 8B model on an H200 spent ~1.2 ms of its ~7 ms in small kernels: RoPE as
torch ops is eight launches per layer (two gathers, two casts, neg, cat, two multiplies and
an add), the residual add and RMSNorm two, SwiGLU two. Each op here is one launch that
reads its inputs once and rounds once, computing in float32.

Used only for bfloat16/float16 tensors on CUDA (the float32 path keeps torch's ops, whose bits
the parity tests compare); tested on CPU under TRITON_INTERPRET=1 against those torch ops
(tests/test_triton_ops.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _rope_kernel(X, positions, cos, sin, stride_t, stride_h, n_heads, half,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(positions + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    i_ok = i < half
    ok = (h < n_heads) & i_ok
    row = pos * 2 * half
    c1 = tl.load(cos + row + i, mask=i_ok, other=0.0)
    c2 = tl.load(cos + row + half + i, mask=i_ok, other=0.0)
    s1 = tl.load(sin + row + i, mask=i_ok, other=0.0)
    s2 = tl.load(sin + row + half + i, mask=i_ok, other=0.0)
    base = X + t.to(tl.int64) * stride_t + h * stride_h
    x1 = tl.load(base + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=ok, other=0.0).to(tl.float32)
    # rotate-half: [x1, x2] * cos + [-x2, x1] * sin
    tl.store(base + i, (x1 * c1 - x2 * s1).to(X.dtype.element_ty), mask=ok)
    tl.store(base + half + i, (x2 * c2 + x1 * s2).to(X.dtype.element_ty), mask=ok)


def rope_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> torch.Tensor:
    """Rotate qk [T, heads, head_dim] (a view whose last dimension is contiguous) in place;
    cos/sin: float32 [positions, head_dim] tables."""
    T, heads, d = qk.shape
    assert qk.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    if T:
        _rope_kernel[(T,)](qk, positions, cos, sin, qk.stride(0), qk.stride(1), heads, d // 2,
                           BLOCK_H=_pow2(heads), BLOCK_HALF=_pow2(d // 2))
    return qk


@triton.jit
def _rope_store_kernel(QKV, positions, slots, cos, sin, K, V, stride_t, n_heads, n_kv, half,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       block_size, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                       BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(positions + t).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]                  # query heads, then key heads
    i = tl.arange(0, BLOCK_HALF)[None, :]
    i_ok = i < half
    ok = (h < n_heads + n_kv) & i_ok
    row = pos * 2 * half
    c1 = tl.load(cos + row + i, mask=i_ok, other=0.0)
    c2 = tl.load(cos + row + half + i, mask=i_ok, other=0.0)
    s1 = tl.load(sin + row + i, mask=i_ok, other=0.0)
    s2 = tl.load(sin + row + half + i, mask=i_ok, other=0.0)
    base = QKV + t.to(tl.int64) * stride_t + h * 2 * half
    x1 = tl.load(base + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=ok, other=0.0).to(tl.float32)
    y1 = (x1 * c1 - x2 * s1).to(QKV.dtype.element_ty)       # rounded as the GEMM's output is
    y2 = (x2 * c2 + x1 * s2).to(QKV.dtype.element_ty)
    is_q = h < n_heads
    tl.store(base + i, y1, mask=ok & is_q)
    tl.store(base + half + i, y2, mask=ok & is_q)
    # keys go to their cache slot only; values are copied there as they are
    page, off = slot // block_size, slot % block_size
    k_at = K + page * stride_kb + off * stride_ks + (h - n_heads) * stride_kh
    k_ok = ok & (h >= n_heads)
    tl.store(k_at + i, y1.to(K.dtype.element_ty), mask=k_ok)
    tl.store(k_at + half + i, y2.to(K.dtype.element_ty), mask=k_ok)
    g = tl.arange(0, BLOCK_KV)[:, None]
    j = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    v_ok = (g < n_kv) & (j < 2 * half)
    v = tl.load(QKV + t.to(tl.int64) * stride_t + (n_heads + n_kv + g) * 2 * half + j,
                mask=v_ok, other=0.0)
    tl.store(V + page * stride_vb + off * stride_vs + g * stride_vh + j,
             v.to(V.dtype.element_ty), mask=v_ok)


def rope_store_(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """One launch for what `rope_` and the backends' `write_kv` do in three: rotate the queries
    of qkv [T, (H + 2·KVH)·hd] in place, and store the rotated keys and the values in their
    cache slots (caches [blocks, block_size, KVH, hd]). Returns the queries, [T, H, hd]."""
    T = qkv.shape[0]
    assert qkv.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if T:
        _rope_store_kernel[(T,)](
            qkv, positions, slots, cos, sin, k_cache, v_cache, qkv.stride(0), n_heads, n_kv,
            head_dim // 2, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_cache.shape[1],
            BLOCK_H=_pow2(n_heads + n_kv), BLOCK_KV=_pow2(n_kv), BLOCK_HALF=_pow2(head_dim // 2))
    return qkv[:, :n_heads * head_dim].view(T, n_heads, head_dim)


@triton.jit
def _add_rms_norm_kernel(X, D, W, Out, stride_x, stride_d, stride_o, n, eps,
                         BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(X + t * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    x += tl.load(D + t * stride_d + i, mask=ok, other=0.0).to(tl.float32)
    x = x.to(X.dtype.element_ty)                # the residual stream keeps its dtype
    tl.store(X + t * stride_x + i, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(W + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_o + i, (xf * rstd * w).to(Out.dtype.element_ty), mask=ok)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                  out: torch.Tensor) -> torch.Tensor:
    """x += delta in place (rounded to x's dtype), then out = RMSNorm(x) * weight."""
    T, n = x.shape
    assert x.stride(-1) == 1 and delta.stride(-1) == 1 and out.stride(-1) == 1
    if T:
        _add_rms_norm_kernel[(T,)](x, delta, weight, out, x.stride(0), delta.stride(0),
                                   out.stride(0), n, eps, BLOCK=_pow2(n),
                                   num_warps=4 if n <= 2048 else 8)
    return out


@triton.jit
def _silu_and_mul_kernel(GU, H, stride_gu, stride_h, n, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(GU + t * stride_gu + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + t * stride_gu + n + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(H + t * stride_h + i, (g / (1.0 + tl.exp(-g)) * u).to(H.dtype.element_ty),
             mask=ok)


def silu_and_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    """[T, 2n] (gate | up) -> silu(gate) * up, [T, n]."""
    T = gate_up.shape[0]
    assert gate_up.stride(-1) == 1
    h = gate_up.new_empty((T, n))
    block = 1024
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(n, block))](gate_up, h, gate_up.stride(0),
                                                          h.stride(0), n, BLOCK=block)
    return h


@triton.jit
def _argmax_part_kernel(X, part_v, part_i, stride_x, n, parts, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    i = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + r * stride_x + i, mask=i < n, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)          # a NaN counts as the largest, as in torch
    m = tl.max(x, 0)
    first = tl.min(tl.where(x == m, i, n), 0)      # the first index holding it
    tl.store(part_v + r * parts + b, m)
    tl.store(part_i + r * parts + b, first)


@triton.jit
def _argmax_merge_kernel(part_v, part_i, out, parts, BLOCK_P: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    ok = p < parts
    v = tl.load(part_v + r * parts + p, mask=ok, other=float("-inf"))
    idx = tl.load(part_i + r * parts + p, mask=ok, other=0)
    m = tl.max(v, 0)
    tl.store(out + r, tl.min(tl.where(ok & (v == m), idx, 2147483647), 0).to(tl.int64))


ARGMAX_BLOCK = 4096


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a 2-D tensor as two launches: the largest of each 4,096-column
    part, then the first of the parts' winners. torch's reduction gives one H200 SM each row
    (37 µs for a row of 128,256 logits); this spreads a row over the GPU. A NaN counts as the
    largest value, as in torch (only where a row holds a NaN and +inf both can they differ)."""
    R, n = x.shape
    assert x.stride(-1) == 1 and 0 < n < 2 ** 31
    parts = triton.cdiv(n, ARGMAX_BLOCK)
    part_v = torch.empty((R, parts), dtype=torch.float32, device=x.device)
    part_i = torch.empty((R, parts), dtype=torch.int32, device=x.device)
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R:
        _argmax_part_kernel[(R, parts)](x, part_v, part_i, x.stride(0), n, parts,
                                        BLOCK=ARGMAX_BLOCK, num_warps=8)
        _argmax_merge_kernel[(R,)](part_v, part_i, out, parts, BLOCK_P=_pow2(parts))
    return out
