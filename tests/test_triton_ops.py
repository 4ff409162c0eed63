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

from gpu_worker.model import triton_ops  # noqa: E402
from gpu_worker.model.layers import RotaryEmbedding  # noqa: E402

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
