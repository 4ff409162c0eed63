"""gpu_worker/model/triton_ops.py (the GPU's fused RoPE, residual add + RMSNorm, SwiGLU) run
by Triton's interpreter on CPU tensors, against the torch ops they replace on a GPU."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton, in the dev extra)",
                allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)

from gpu_worker.attention.torch_backend import write_kv  # noqa: E402
from gpu_worker.model import triton_gemv, triton_ops  # noqa: E402
from gpu_worker.model.layers import RotaryEmbedding  # noqa: E402
from tests.test_sampler import argmax_case  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(4, 2, 16), (6, 2, 24)])   # 8 and 10 heads of qk
def test_rope_in_place_equals_rotate_half(dtype, heads, kvh, d):
    g = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(d, 64, 10000.0)
    T = 7
    qkv = torch.randn(T, (heads + 2 * kvh) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 63, 1, 2, 30, 17])
    qk = qkv[:, :(heads + kvh) * d].view(T, -1, d)            # a strided view, as the model has
    want = rotary(positions, qk.clone())                      # torch's ops off the GPU
    v_before = qkv[:, (heads + kvh) * d:].clone()
    triton_ops.rope_(qk, positions, rotary.cos, rotary.sin)
    torch.testing.assert_close(qk.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, (heads + kvh) * d:], v_before)  # V untouched


@pytest.mark.parametrize("cache_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d,bs", [(4, 2, 16, 16), (6, 2, 24, 5), (3, 3, 8, 1)])
def test_rope_store_equals_rope_then_write_kv(dtype, cache_dtype, heads, kvh, d, bs):
    """The one launch of the Triton backend (queries rotated in place, rotated keys and the
    values stored in their slots) against torch's RoPE and write_kv, bit for bit in the cache
    dtype; slots in any order, over several pages, the rest of the cache untouched."""
    cache_dtype = cache_dtype or dtype
    g = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(d, 64, 10000.0)
    T, blocks = 7, 12
    qkv = torch.randn(T, (heads + 2 * kvh) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 63, 1, 2, 30, 17])
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    pool = torch.randn(2, blocks, bs, kvh, d, generator=g).to(cache_dtype)
    want_pool, want_qkv = pool.clone(), qkv.clone()
    qk = want_qkv[:, :(heads + kvh) * d].view(T, -1, d)
    triton_ops.rope_(qk, positions, rotary.cos, rotary.sin)      # the three launches it replaces
    write_kv(qk[:, heads:], want_qkv[:, (heads + kvh) * d:].view(T, kvh, d), want_pool[0],
             want_pool[1], slots)
    q = triton_ops.rope_store_(qkv, positions, slots, rotary.cos, rotary.sin, pool[0], pool[1],
                               heads, kvh, d)
    assert q.shape == (T, heads, d) and q.data_ptr() == qkv.data_ptr()
    assert torch.equal(q, want_qkv[:, :heads * d].view(T, heads, d))
    assert torch.equal(pool, want_pool)
    assert torch.equal(qkv[:, (heads + kvh) * d:], want_qkv[:, (heads + kvh) * d:])  # V as was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 96])
def test_add_rms_norm(dtype, n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, n, generator=g).to(dtype)
    delta = torch.randn(5, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    x_ref = x.clone().add_(delta)
    want = F.rms_norm(x_ref.float(), (n,), w.float(), 1e-5)
    out = torch.empty(5, n, dtype=dtype)
    triton_ops.add_rms_norm_(x, delta, w, 1e-5, out)
    # the residual stream, in its dtype (the interpreter rounds float32 -> bfloat16 toward
    # zero where a GPU rounds to nearest: one unit in the last place apart at most)
    torch.testing.assert_close(x.float(), x_ref.float(), atol=0, rtol=2 ** -7)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(2)
    n = 1500                                       # more than one block of 1024
    gate_up = torch.randn(3, 2 * n, generator=g).to(dtype)
    want = F.silu(gate_up[:, :n].float()) * gate_up[:, n:].float()
    got = triton_ops.silu_and_mul(gate_up, n)
    assert got.shape == (3, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("vocab", [1, 17, 4096, 4097, 9000])
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_argmax_rows_is_torchs(rows, vocab):
    """The GPU's greedy argmax against torch.argmax on the sampler tests' hard cases, with the
    tie across two 4,096-column parts where the vocabulary has two."""
    x = argmax_case(rows, vocab, tie=(5, 4096) if vocab > 4096 else (1, 3))
    assert torch.equal(triton_ops.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,tile", [(37, 300, (4, 128)), (64, 1024, (16, 256)),
                                      (5, 2100, (8, 512))])
def test_gemv_equals_linear(dtype, n, k, tile):
    """The one-row GEMM (gpu_worker/model/triton_gemv.py) against F.linear in float32: shapes
    that fill neither tile dimension; off a GPU it never serves the model."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(1, k, generator=g).to(dtype)
    got = triton_gemv.gemv(x, w, tile)
    assert got.shape == (1, n) and got.dtype == dtype
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    assert not triton_gemv.serves(x, w)
