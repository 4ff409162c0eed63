"""Our Triton paged-attention kernel (gpu_worker/attention/triton_backend.py) run by Triton's
interpreter on CPU tensors, against the torch backend: fresh prompts, later chunks over a
cached prefix, decodes, all in one launch; GQA; block sizes 16 and 32 (and odd ones)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# read when a kernel is decorated and launched: set before the kernel module is imported
os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton, in the dev extra)",
                allow_module_level=True)
if os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is set to something other than 1 and there is no GPU",
                allow_module_level=True)

from gpu_worker.attention import Chunk, build_attention_metadata  # noqa: E402
from gpu_worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from gpu_worker.attention.triton_backend import TritonAttentionBackend, paged_attention  # noqa: E402
from gpu_worker.attention import triton_backend  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"


def _case(chunks_spec, bs, heads, kvh, d, dtype, seed=0, blocks=48):
    """Random caches, a shuffled block pool, and the iteration's q/k/v."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(blocks, bs, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    chunks, used = [], 0
    for q_rows, kv_len in chunks_spec:
        n = -(-kv_len // bs)
        chunks.append(Chunk(q_rows, kv_len, perm[used:used + n]))
        used += n
    assert used <= blocks
    T = sum(q for q, _ in chunks_spec)
    q, k, v = (torch.randn(T, n, d, generator=g).to(dtype) for n in (heads, kvh, kvh))
    return chunks, q, k, v, k_cache, v_cache


def _both(chunks, q, k, v, k_cache, v_cache, bs, **tiles):
    scale = q.shape[-1] ** -0.5
    meta = build_attention_metadata(chunks, bs, DEVICE, q.dtype)
    ref = TorchAttentionBackend(None).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)
    kc, vc = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    if tiles:
        from gpu_worker.attention.torch_backend import write_kv
        write_kv(k.to(DEVICE), v.to(DEVICE), kc, vc, meta.slot_mapping)
        out = paged_attention(q.to(DEVICE), kc, vc, meta, scale, **tiles)
    else:
        out = TritonAttentionBackend().forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kc, vc,
                                               meta, scale)
    return out.cpu(), ref


# (q_rows, kv_len): fresh prompts (q == kv), later chunks over a cached prefix, decodes
MIXED = [(5, 5), (1, 17), (3, 20), (1, 1), (7, 40), (1, 33)]


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("heads,kvh", [(4, 1), (6, 2), (4, 4)])     # GQA 4, GQA 3 (padded), MHA
def test_mixed_iteration_float32(bs, heads, kvh):
    out, ref = _both(*_case(MIXED, bs, heads, kvh, 16, torch.float32), bs)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


@pytest.mark.parametrize("spec", [
    [(9, 9), (4, 4)],                  # fresh prompts only
    [(6, 38), (2, 18)],                # later chunks over cached prefixes only
    [(1, 1), (1, 16), (1, 17), (1, 45)],   # decodes only, prefixes across page edges
])
def test_each_kind_alone(spec):
    out, ref = _both(*_case(spec, 16, 8, 2, 32, torch.float32, seed=1), 16)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


@pytest.mark.parametrize("bs,block_n,rows", [(16, 32, 16), (32, 16, 16), (5, 16, 32), (1, 16, 16)])
def test_tiles_that_span_pages_and_query_tiles(bs, block_n, rows):
    """Key tiles wider and narrower than a page, block sizes that are not a power of two, and
    chunks longer than one query tile."""
    spec = [(11, 11), (9, 30), (1, 23)]
    out, ref = _both(*_case(spec, bs, 4, 2, 24, torch.float32, seed=2, blocks=80), bs,
                     block_n=block_n, rows=rows)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


def test_bfloat16():
    out, ref = _both(*_case(MIXED, 16, 4, 2, 32, torch.bfloat16, seed=3), 16)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref.float(), atol=3e-2, rtol=3e-2), \
        (out.float() - ref.float()).abs().max()


@pytest.mark.parametrize("fused_combine", [True, False])
@pytest.mark.parametrize("split_len", [16, 32])
@pytest.mark.parametrize("heads,kvh", [(4, 1), (6, 2)])
def test_split_kv_decodes(split_len, heads, kvh, fused_combine, monkeypatch):
    """Decodes alone with each request's keys cut into slices (split-KV) and merged: contexts
    shorter than a slice, on a slice edge and across several (more than the merge reads at
    once), block size 16 and key tile 16; merged by the last slice's program or by a kernel of
    its own. The merge's counts are left zero for the next call."""
    monkeypatch.setattr(triton_backend, "FUSED_COMBINE", fused_combine)
    monkeypatch.setattr(triton_backend, "_counters", {})
    spec = [(1, 1), (1, 16), (1, 17), (1, 45), (1, 64), (1, 150)]
    for _ in range(2):
        out, ref = _both(*_case(spec, 16, heads, kvh, 24, torch.float32, seed=4, blocks=40),
                         16, block_n=16, split_len=split_len)
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()
    assert all(not c.any() for c in triton_backend._counters.values())
    assert bool(triton_backend._counters) == fused_combine


def test_split_kv_bfloat16():
    spec = [(1, 40), (1, 3)]
    out, ref = _both(*_case(spec, 16, 8, 2, 32, torch.bfloat16, seed=5), 16, block_n=16,
                     split_len=16)
    assert torch.allclose(out.float(), ref.float(), atol=3e-2, rtol=3e-2), \
        (out.float() - ref.float()).abs().max()
