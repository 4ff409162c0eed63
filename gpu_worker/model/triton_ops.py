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
