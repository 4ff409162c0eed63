"""The C++ CPU kernels (attention reading K/V in place through block tables, fused ops) against
the torch path, for every ISA level the build made and this CPU runs (a level the CPU lacks is
skipped, saying so)."""
from __future__ import annotations

import os

import pytest
import torch

from gpu_worker import kernel_build
from gpu_worker.attention import Chunk, build_attention_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.cpu_kernels import cpu_kernels
from shared.cpu import cpu_flags

RUNNABLE = kernel_build.supported_levels(cpu_flags())


@pytest.fixture(params=kernel_build.LEVEL_NAMES)
def kernels(request):
    """The kernel module of one ISA level."""
    if request.param not in RUNNABLE:
        pytest.skip(f"this CPU cannot run the {request.param} kernels (it runs {', '.join(RUNNABLE)})")
    module = cpu_kernels(request.param)
    assert module is not None, f"the {request.param} kernels are not built: run `make setup`"
    assert module.level == request.param
    return module


def test_the_kernels_of_this_cpu_are_built():
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels are not built: run `make setup`"
    # the best level this CPU runs, or the one a run held lower asks for (PACER_CPU_ISA)
    assert kernels.level == (os.environ.get("PACER_CPU_ISA", "").strip() or RUNNABLE[-1])


def _decodes(g, kv_lens: list[int], blocks: int, kvh: int, d: int, cache_dtype, bs: int = 16):
    """Random K/V caches and the metadata of one decode row per kv_len, blocks scattered."""
    k_cache = torch.randn(blocks, bs, kvh, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(blocks, bs, kvh, d, generator=g).to(cache_dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    chunks, used = [], 0
    for kv_len in kv_lens:
        n = -(-kv_len // bs)
        chunks.append(Chunk(1, kv_len, perm[used:used + n]))
        used += n
    return k_cache, v_cache, build_attention_metadata(chunks, bs)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
# AVX-512 and generic; groups of 8 at head_dim 64 and of 4 at 128 take two passes over V
@pytest.mark.parametrize("heads,kvh,d,bs", [(9, 3, 64, 16), (8, 2, 128, 16), (6, 2, 32, 16),
                                            (9, 3, 64, 5), (8, 2, 128, 32), (16, 2, 64, 16)])
def test_decode_kernel_matches_the_torch_path(kernels, cache_dtype, heads, kvh, d, bs):
    """Decodes over contexts of many lengths; block sizes that split 16-key groups (5) or hold
    two (32) take the kernel's per-key and per-block addressing."""
    g = torch.Generator().manual_seed(0)
    # decodes over prefixes of many shapes
    k_cache, v_cache, meta = _decodes(g, [1, 7, 16, 17, 100, 333, 1500], 700, kvh, d,
                                      cache_dtype, bs)
    T = meta.positions.shape[0]
    q = torch.randn(T, heads, d, generator=g)
    k = torch.randn(T, kvh, d, generator=g)
    v = torch.randn(T, kvh, d, generator=g)
    fast = TorchAttentionBackend(kernels).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), meta, d ** -0.5)
    ref = TorchAttentionBackend(None).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, d ** -0.5)
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-5), (fast - ref).abs().max()


def test_mixed_iteration_uses_both_paths_consistently(kernels):
    """A prefill chunk over a cached prefix beside decodes: rows land where they belong."""
    g = torch.Generator().manual_seed(1)
    blocks, bs, kvh, heads, d = 64, 4, 2, 4, 8
    k_cache, v_cache = torch.randn(blocks, bs, kvh, d, generator=g), torch.randn(blocks, bs, kvh, d, generator=g)
    chunks = [Chunk(1, 6, [3, 9]), Chunk(5, 9, [1, 2, 7]), Chunk(1, 3, [11])]
    meta = build_attention_metadata(chunks, bs)
    T = sum(c.q_rows for c in chunks)
    q, k, v = (torch.randn(T, n, d, generator=g) for n in (heads, kvh, kvh))
    fast = TorchAttentionBackend(kernels).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.3)
    ref = TorchAttentionBackend(None).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.3)
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d,bs", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 16),
                                            (9, 3, 64, 5)])     # a block size that splits key blocks
def test_prefill_kernel_matches_the_torch_path(kernels, cache_dtype, heads, kvh, d, bs):
    """Fresh prompts, later chunks over cached prefixes (block boundaries inside and outside a
    16-key block, tiles of 32 rows and their remainders) and decodes in one iteration."""
    if not kernels.paged_prefill_supported(d, heads // kvh):
        assert kernels.level == "generic"
        pytest.skip(f"the {kernels.level} kernels have no prefill attention: torch serves it")
    g = torch.Generator().manual_seed(2)
    blocks = 300 * 16 // bs
    k_cache = torch.randn(blocks, bs, kvh, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(blocks, bs, kvh, d, generator=g).to(cache_dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    shapes = [(5, 5), (1, 40), (33, 33), (64, 100), (17, 17), (1, 7), (100, 257), (2, 2), (31, 47)]
    chunks, used = [], 0
    for q_rows, kv_len in shapes:
        n = -(-kv_len // bs)
        chunks.append(Chunk(q_rows, kv_len, perm[used:used + n]))
        used += n
    meta = build_attention_metadata(chunks, bs)
    T = sum(c.q_rows for c in chunks)
    q, k, v = (torch.randn(T, n, d, generator=g) for n in (heads, kvh, kvh))
    fast = TorchAttentionBackend(kernels).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, d ** -0.5)
    ref = TorchAttentionBackend(None).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, d ** -0.5)
    assert torch.allclose(fast, ref, atol=2e-5, rtol=1e-4), (fast - ref).abs().max()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_row_has_the_same_bits_whatever_chunk_it_ends(kernels, cache_dtype):
    """A prompt's last row, in one chunk with the rest of its prompt or alone (the token
    budget cut the prompt one row short), comes from the prefill kernel either way: the decode
    kernel sums in another order, and its bits would change the greedy tokens after it."""
    if not kernels.paged_prefill_supported(64, 3):
        pytest.skip(f"the {kernels.level} kernels have no prefill attention: torch serves it")
    g = torch.Generator().manual_seed(5)
    bs, n = 16, 41
    table = torch.randperm(20, generator=g)[:3].tolist()
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (9, 3, 3))
    cache = [torch.zeros(20, bs, 3, 64, dtype=cache_dtype) for _ in range(2)]
    backend = TorchAttentionBackend(kernels)
    whole = backend.forward(q, k, v, *[c.clone() for c in cache],
                            build_attention_metadata([Chunk(n, n, table)], bs), 0.125)
    k_cache, v_cache = (c.clone() for c in cache)
    backend.forward(q[:-1], k[:-1], v[:-1], k_cache, v_cache,
                    build_attention_metadata([Chunk(n - 1, n - 1, table, samples=False)], bs),
                    0.125)
    for prompt_row in (True, False):                # False: the same row taken as a decode
        last = backend.forward(q[-1:], k[-1:], v[-1:], k_cache.clone(), v_cache.clone(),
                               build_attention_metadata([Chunk(1, n, table,
                                                               prompt_row=prompt_row)], bs),
                               0.125)
        torch.testing.assert_close(last[0], whole[-1])
        if prompt_row:
            assert torch.equal(last[0], whole[-1])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(9, 3, 64), (8, 2, 128)])
def test_prompt_rows_have_the_same_bits_whatever_their_tiles(kernels, cache_dtype, heads, kvh, d):
    """The prefill kernel sizes its row tiles by the iteration (how many chunks, how many rows,
    the threads): a prompt's rows cut into other chunks, or beside other prompts, come out the
    same bits."""
    if not kernels.paged_prefill_supported(d, heads // kvh):
        pytest.skip(f"the {kernels.level} kernels have no prefill attention: torch serves it")
    g = torch.Generator().manual_seed(6)
    bs, n, blocks = 16, 300, 64
    table = torch.randperm(blocks, generator=g)[:-(-n // bs)].tolist()
    other = [b for b in range(blocks) if b not in table][:20]
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kvh, kvh))
    backend = TorchAttentionBackend(kernels)
    k_cache, v_cache = (torch.zeros(blocks, bs, kvh, d, dtype=cache_dtype) for _ in range(2))
    whole = backend.forward(q, k, v, k_cache, v_cache,
                            build_attention_metadata([Chunk(n, n, table, samples=False)], bs), d ** -0.5)
    # the cache now holds the whole prompt's K/V: recompute its rows cut at other places
    for cuts in ([0, 7, 300], [0, 250, 263, 300], [0, 2, 4, 100, 300]):   # chunks of 2+ rows
        got = torch.cat([backend.forward(
            q[a:b], k[a:b], v[a:b], k_cache, v_cache,
            build_attention_metadata([Chunk(b - a, b, table, samples=False)], bs), d ** -0.5)
            for a, b in zip(cuts, cuts[1:])])
        assert torch.equal(got, whole), cuts
    # beside a 300-row prompt of its own, and beside decodes: other tiles, the same rows
    q2, k2, v2 = (torch.randn(300, h, d, generator=g) for h in (heads, kvh, kvh))
    meta = build_attention_metadata([Chunk(45, 300, table, samples=False),
                                     Chunk(300, 300, other[:19], samples=False)], bs)
    got = backend.forward(torch.cat([q[-45:], q2]), torch.cat([k[-45:], k2]),
                          torch.cat([v[-45:], v2]), k_cache, v_cache, meta, d ** -0.5)
    assert torch.equal(got[:45], whole[-45:])


def test_prefill_kernel_packs_long_prefixes_in_rounds(kernels):
    """Chunks whose packed K/V together exceed the kernel's packing buffer (8M floats) are
    packed and attended a round at a time: here ten chunks over 2,300-key prefixes (~8.8M
    floats), against the torch path."""
    if not kernels.paged_prefill_supported(64, 3):
        pytest.skip(f"the {kernels.level} kernels have no prefill attention: torch serves it")
    g = torch.Generator().manual_seed(7)
    bs, n_chunks, kv_len, rows = 16, 10, 2300, 3
    per = -(-kv_len // bs)
    k_cache, v_cache = (torch.randn(n_chunks * per, bs, 3, 64, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    perm = torch.randperm(n_chunks * per, generator=g).tolist()
    chunks = [Chunk(rows, kv_len, perm[i * per:(i + 1) * per], samples=False)
              for i in range(n_chunks)]
    meta = build_attention_metadata(chunks, bs)
    q, k, v = (torch.randn(n_chunks * rows, h, 64, generator=g) for h in (9, 3, 3))
    fast = TorchAttentionBackend(kernels).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    ref = TorchAttentionBackend(None).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    assert torch.allclose(fast, ref, atol=2e-5, rtol=1e-4), (fast - ref).abs().max()


def test_fused_norm_and_rotary_match_torch(kernels):
    """The bfloat16-weight path's fused ops against the torch ops they replace."""
    from gpu_worker.model.layers import RMSNorm, RotaryEmbedding
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 576, generator=g)
    delta = torch.randn(37, 576, generator=g)
    plain, fused = RMSNorm(576, 1e-5), RMSNorm(576, 1e-5)
    fused.fused = kernels
    for n in (plain, fused):
        n.weight.data.copy_(torch.randn(576, generator=g) if n is plain else plain.weight)
    x1, x2 = x.clone(), x.clone()
    ref = plain.add_(x1, delta, torch.bfloat16)
    out = fused.add_(x2, delta, torch.bfloat16)
    assert torch.equal(x1, x2)                                   # the residual add, in place
    assert out.dtype == torch.bfloat16
    # the sum of squares is accumulated in another order: at most one bfloat16 ulp apart
    assert torch.allclose(out.float(), ref.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.allclose(fused(x, torch.float32), plain(x), rtol=1e-5, atol=1e-6)

    rot = RotaryEmbedding(64, 4096, 100000.0)
    qkv = torch.randn(37, 15 * 64, generator=g)
    qk = qkv[:, :12 * 64].view(37, 12, 64)                       # strided rows, as in the model
    positions = torch.randint(0, 4096, (37,), generator=g)
    values = qkv[:, 12 * 64:].clone()
    ref = rot(positions, qk.clone())
    rot.fused = kernels
    got = rot(positions, qk)
    assert got.data_ptr() == qkv.data_ptr()                      # rotated in place
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 12 * 64:], values)                 # V, beside it, untouched


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(9, 3, 64), (6, 2, 32)])      # AVX-512 path, generic
def test_decode_block_equals_the_op_by_op_path(kernels, cache_dtype, heads, kvh, d):
    """RoPE + K/V store + decode attention as one op, from a bfloat16 qkv, against the ops it
    replaces (widen, rotary_, write_kv, paged_decode_attention, round): the same cache bits
    and the same output bits."""
    from gpu_worker.model.layers import RotaryEmbedding
    g = torch.Generator().manual_seed(7)
    bs = 16
    k_cache, v_cache, meta = _decodes(g, [1, 17, 100, 250], 64, kvh, d, cache_dtype, bs)
    T = meta.positions.shape[0]
    qkv = torch.randn(T, (heads + 2 * kvh) * d, generator=g).to(torch.bfloat16)
    rot = RotaryEmbedding(d, 1024, 10000.0)
    rot.fused = kernels
    backend = TorchAttentionBackend(kernels)
    k1, v1 = k_cache.clone(), v_cache.clone()
    wide = qkv.float()
    qk = rot(meta.positions, wide[:, :(heads + kvh) * d].view(T, -1, d))
    v = wide[:, (heads + kvh) * d:].view(T, kvh, d)
    ref = backend.forward(qk[:, :heads], qk[:, heads:], v, k1, v1, meta, d ** -0.5)
    ref = ref.reshape(T, heads * d).to(torch.bfloat16)
    k2, v2 = k_cache.clone(), v_cache.clone()
    got = backend.decode_block(qkv, rot, (k2, v2), meta, d ** -0.5, heads * d)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(got, ref)
    # an iteration with a prefill chunk is not the block's: None, the caller goes op by op
    mixed = build_attention_metadata([Chunk(1, 5, [0]), Chunk(3, 3, [1])], bs)
    assert backend.decode_block(qkv[:4].new_zeros(4, qkv.shape[1]), rot, (k2, v2), mixed,
                                d ** -0.5, heads * d) is None


def test_fused_norm_adds_a_bfloat16_delta(kernels):
    """The residual add of a bfloat16 GEMM output, widened in the norm's pass: the same x as
    adding the widened tensor, the same norm as with a float32 delta."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 576, generator=g)
    delta = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    w = torch.randn(576, generator=g)
    x1, x2, x3 = x.clone(), x.clone(), x + delta.float()
    out1, out2, out3 = (torch.empty(64, 576, dtype=torch.bfloat16) for _ in range(3))
    kernels.add_rms_norm(x1, delta, w, 1e-5, out1)
    kernels.add_rms_norm(x2, delta.float(), w, 1e-5, out2)
    kernels.add_rms_norm(x3, None, w, 1e-5, out3)                 # added beforehand
    assert torch.equal(x1, x + delta.float()) and torch.equal(x1, x2)
    assert torch.equal(out1, out2) and torch.equal(out1, out3)


def test_fused_silu_and_mul_matches_torch(kernels):
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(37, 2 * 1000, generator=g) * 4).to(torch.bfloat16)   # f not a multiple of 16
    out = gate_up.new_empty((37, 1000))
    kernels.silu_and_mul(gate_up, out)
    exact = (torch.nn.functional.silu(gate_up[:, :1000].float()) * gate_up[:, 1000:].float())
    # within one bfloat16 ulp of the exact value (rounded once; the exp is approximated)
    assert torch.allclose(out.float(), exact, rtol=2 ** -7, atol=1e-30)
    torch_bf16 = torch.nn.functional.silu(gate_up[:, :1000]) * gate_up[:, 1000:]
    assert (out.float() - exact).abs().max() <= (torch_bf16.float() - exact).abs().max()


def test_prepacked_bf16_gemm_gives_the_same_bits_for_every_batch_size():
    from gpu_worker.model.layers import _matmul, prepack
    g = torch.Generator().manual_seed(4)
    w = torch.randn(960, 576, generator=g).to(torch.bfloat16)
    packed = prepack(w)
    if packed is None:      # torch's bf16 prepack needs avx512bw/vl/dq or avx_ne_convert
        pytest.skip("this CPU has no oneDNN bf16 linear prepack (no AVX-512 BW/VL/DQ)")
    for rows in (1, 7, 64, 333, 1024):
        x = torch.randn(rows, 576, generator=g)
        assert torch.equal(_matmul(x, w, packed=packed), _matmul(x, w)), rows
    assert prepack(w.float()) is None                      # float32 keeps F.linear's bits


def test_a_bf16_gemm_row_has_the_same_bits_alone_as_in_a_batch():
    """oneDNN's bfloat16 GEMM sums a lone row otherwise than the same row among others (seen
    with small activations, as real ones are): `_matmul` computes a lone row as two, so a
    token's bits never depend on what shares its iteration."""
    from gpu_worker.model.layers import _matmul, prepack
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3072, 1536, generator=g) * 0.02).to(torch.bfloat16)
    x = (torch.randn(64, 1536, generator=g) * 1e-3).to(torch.bfloat16)
    for packed in (None, prepack(w)):
        batch = _matmul(x, w, packed=packed)
        assert torch.equal(_matmul(x[:2], w, packed=packed), batch[:2])
        # (the orders differ in the last float32 bits: one row in ten or so rounds otherwise)
        assert all(torch.equal(_matmul(x[i:i + 1], w, packed=packed), batch[i:i + 1])
                   for i in range(64)), packed is None
