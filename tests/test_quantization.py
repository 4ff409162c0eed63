"""Quantized weights (gpu_worker/quant, --quantization): GGUF Q4_0/Q4_1/Q8_0 blocks load as
codes + scales that dequantize to exactly the `gguf` package's values; the int4/int8 GEMMs
match a dequantized reference within stated tolerances for the model's shapes and odd ones;
`auto` picks the file's own precision; refusals say why; tp=3 int4 gives tp=1's tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from gpu_worker.quant import linear, resolve_quantization
from gpu_worker.quant.linear import ACT_DTYPE, Int4Weight, Int8Weight
from gpu_worker.quant.tensor import QTensor, from_gguf, quantize_int4, quantize_int8, to_scheme
from gpu_worker.weights import iter_weights
from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.errors import PacerError
from shared.model_config import load_model_config
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.helpers_tiny_model import write_tiny_gguf, write_tiny_llama

# SmolLM2-135M's matrices (N, K): qkv, o, gate_up, down, LM head; then odd ones (N not a
# multiple of 16: padded; K of one group; K of three groups)
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ODD_SHAPES = [(40, 64), (17, 32), (48, 96), (320, 192)]


def _random(n: int, k: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    # rows of different magnitudes, and a few outliers: scales differ group to group
    return (g.standard_normal((n, k)) * g.uniform(0.01, 1.0, (n, 1))
            + (g.random((n, k)) < 0.01) * 4.0).astype(np.float32)


# ---- GGUF blocks ---------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(64, 32), (48, 96), (960, 576)])
def test_gguf_blocks_dequantize_to_the_gguf_reference(qtype, shape):
    w = _random(*shape)
    raw = quantize(w, qtype)
    q = from_gguf(raw, qtype, shape)
    assert q.scheme == ("int8" if qtype == Q.Q8_0 else "int4") and q.group == 32
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(shape).astype(np.float32))
    if qtype == Q.Q4_1:   # zero = m + 8·d is one rounding away from q·d + m
        torch.testing.assert_close(q.dequantize(), reference, rtol=0, atol=1e-6)
    else:
        assert torch.equal(q.dequantize(), reference)


@pytest.mark.parametrize("shape", [(8, 256), (48, 768)])
def test_q4_k_blocks_are_int4_groups_exactly(shape):
    """A Q4_K super-block's eight sub-blocks are eight int4 groups of 32, scale d·sc and
    zero 8·d·sc - dmin·m: the same weights as gguf-py's dequantize (random blocks: every
    6-bit scale and min, every code)."""
    from tests.helpers_tiny_model import encode_gguf_tensor
    raw = encode_gguf_tensor(_random(*shape), Q.Q4_K)
    q = from_gguf(raw, Q.Q4_K, shape)
    assert (q.scheme, q.group) == ("int4", 32)
    reference = torch.from_numpy(dequantize(raw, Q.Q4_K).reshape(shape).astype(np.float32))
    torch.testing.assert_close(q.dequantize(), reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_quantized_loading_gives_the_dequantized_loaders_values(tmp_path, qtype):
    """Q/K rows unpermuted like the float path; norms stay float."""
    hf = write_tiny_llama(tmp_path / "hf", hidden_size=64, intermediate_size=128)
    path = write_tiny_gguf(tmp_path / "m.gguf", hf, qtype)
    source = resolve_model(path)
    cfg = load_model_config(source)
    floats = dict(iter_weights(source, cfg, progress=False))
    quantized = dict(iter_weights(source, cfg, progress=False, quantized=True))
    assert floats.keys() == quantized.keys()
    for name, t in quantized.items():
        if floats[name].dim() == 1:
            assert isinstance(t, torch.Tensor) and torch.equal(t, floats[name]), name
        else:
            torch.testing.assert_close(t.dequantize(), floats[name], rtol=0, atol=1e-6,
                                       msg=name)


# ---- the GEMMs -----------------------------------------------------------------------------

def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.to(ACT_DTYPE).float() @ w.t()


@pytest.mark.parametrize("shape", MODEL_SHAPES + ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("vnni", [None, False], ids=["default-layout", "torch-layout"])
def test_int4_gemm_matches_its_dequantized_weights(shape, rows, vnni):
    """Whatever layout and kernel serve: the default here, and torch's layout (whose packing
    depends on torch's CPU capability: `torch_int4_layout_is_ours`)."""
    n, k = shape
    q = quantize_int4(torch.from_numpy(_random(n, k, seed=rows)), 32)
    # the kernel's scales are bfloat16: the reference dequantizes with the same ones
    q.scale, q.zero = q.scale.to(ACT_DTYPE).float(), q.zero.to(ACT_DTYPE).float()
    x = torch.randn(rows, k)
    y = Int4Weight(q, vnni=vnni).mm(x)
    assert y.shape == (rows, n) and y.dtype == ACT_DTYPE
    ref = _reference(x, q.dequantize())
    # bfloat16 output (8 bits of mantissa) over sums of k products
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("shape", MODEL_SHAPES + ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_int8_gemm_matches_its_dequantized_weights(shape, rows):
    n, k = shape
    q = quantize_int8(torch.from_numpy(_random(n, k, seed=rows)))
    q.scale = q.scale.to(ACT_DTYPE).float()
    x = torch.randn(rows, k)
    packed = Int8Weight(q)
    y = packed.mm(x)
    assert y.shape == (rows, n) and y.dtype == ACT_DTYPE
    ref = _reference(x, q.dequantize())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(packed.embedding(ids), q.dequantize()[ids])


@pytest.mark.parametrize("shape", [(960, 576), (40, 64), (576, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_many_rows_widen_the_weights_to_exactly_their_values(shape, monkeypatch):
    """From `many_rows` rows on, the CPU kernels widen W to bfloat16 for one bfloat16 GEMM:
    W's values are the ones the int kernels use, rounded once to bfloat16."""
    from gpu_worker.cpu_kernels import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels here: torch's int kernels serve every size")
    if not linear.torch_int4_layout_is_ours():
        pytest.skip("torch packs int4 for another CPU capability here; our kernels do not read it")
    n, k = shape
    q4 = quantize_int4(torch.from_numpy(_random(n, k)), 32)
    w4 = Int4Weight(q4, vnni=False)
    n_pad = w4.scales_zeros.shape[1]
    w_t = torch.empty(k, n_pad, dtype=ACT_DTYPE)
    kernels.dequantize_int4pack(w4.packed, w4.scales_zeros, 32, w_t)
    s, z = (w4.scales_zeros[..., i].float().t()[:n].repeat_interleave(32, dim=1) for i in (0, 1))
    want = ((q4.codes.float() - 8) * s + z).to(ACT_DTYPE)
    assert torch.equal(w_t[:, :n].t(), want) and not w_t[:, n:].any()
    q8 = quantize_int8(torch.from_numpy(_random(n, k)))
    w8 = Int8Weight(q8, vnni=False)
    wide = torch.empty(n, k, dtype=ACT_DTYPE)
    kernels.dequantize_int8(w8.codes, w8.scale, wide)
    assert torch.equal(wide, (q8.codes.float() * w8.scale.float().unsqueeze(1)).to(ACT_DTYPE))
    x = torch.randn(Int4Weight.many_rows + 3, k)
    # the path of CPUs with none of the in-cache kernels (AMX, AVX512-BF16, FMA)
    monkeypatch.setattr(linear, "_amx_kernels", lambda: None)
    monkeypatch.setattr(linear, "_dpbf16_kernels", lambda: None)
    monkeypatch.setattr(linear, "_fma_kernels", lambda: None)
    for packed in (w4, w8):
        wide_y = packed.mm(x)
        monkeypatch.setattr(type(packed), "many_rows", 10 ** 9)
        narrow_y = packed.mm(x)
        assert wide_y.shape == narrow_y.shape == (x.shape[0], n)
        ref = narrow_y.float()
        torch.testing.assert_close(wide_y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


IN_CACHE = {   # kind -> (the kernels when they run here, why not, the rows that reach it, rows tried)
    "amx": (lambda: linear._amx_kernels(),
            "no AMX here (CPU flags amx_tile/amx_bf16, an AVX-512 kernel build)",
            "amx_rows", (16, 33)),
    "dpbf16": (lambda: linear._dpbf16_kernels(),
               "no AVX512-BF16 here (an AVX-512 kernel build, CPU flag avx512_bf16)",
               "dpbf16_rows", (1, 6, 13, 33)),
}


def _chosen(kind: str) -> bool:
    """Whether the weights' own mm takes `kind` here (AMX comes before AVX512-BF16)."""
    return linear._in_cache_kernels()[1] == kind


@pytest.mark.parametrize("shape", MODEL_SHAPES[:4] + [(40, 64), (320, 192)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("kind", sorted(IN_CACHE))
def test_in_cache_int4_gemm_multiplies_the_widened_weights(shape, group, kind):
    """On AMX (csrc/dequant.cpp int4pack_mm_amx) and on AVX512-BF16 without it
    (int4pack_mm_dpbf16) W is widened in cache to the bfloat16 values dequantize_int4pack
    writes and multiplied with float32 sums: equal to the widened GEMM up to the order of the
    sums, so within one bfloat16 rounding; rows in whole tiles (16 on AMX, 6 with vdpbf16ps)
    and not; above the row threshold the weight's own mm takes the kernel chosen here."""
    available, why, threshold, tried = IN_CACHE[kind]
    kernels = available()
    if kernels is None:
        pytest.skip(why)
    threshold = getattr(Int4Weight, threshold)
    n, k = shape
    w4 = Int4Weight(quantize_int4(torch.from_numpy(_random(n, k, seed=group)), group), vnni=False)
    n_pad = w4.scales_zeros.shape[1]
    w_t = torch.empty(k, n_pad, dtype=ACT_DTYPE)
    kernels.dequantize_int4pack(w4.packed, w4.scales_zeros, group, w_t)
    for rows in (threshold, *tried):
        x = torch.randn(rows, k, dtype=ACT_DTYPE)
        y = torch.empty(rows, n_pad, dtype=ACT_DTYPE)
        getattr(kernels, f"int4pack_mm_{kind}")(x, w4.packed, w4.scales_zeros, group, y)
        ref = x.float() @ w_t.float()
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
        if rows >= threshold and _chosen(kind):
            assert torch.equal(w4.mm(x), y[:, :n])


def _w4a8_reference(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """What int4_mm_vnni computes, in float64: x quantized per block of 32 (d = max|x| / 127,
    codes round(x / d), ties to even) times the file's weights."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = (torch.round(xb * inv) * (amax / 127)).view(m, k)
    return xq.double() @ q.dequantize().double().t()


@pytest.mark.parametrize("shape", MODEL_SHAPES[:4] + [(40, 64), (320, 192)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("group", [32, 64])
def test_vnni_int4_gemm_is_its_8_bit_activations_times_the_weights(shape, group):
    """With AVX512-VNNI or AVX2 (csrc/int4_vnni.cpp) the int4 weights are kept in the VNNI
    layout and x is quantized to 8 bits per block of 32: the result is that product up to
    float32 sums and the bfloat16 output's rounding; every row remainder of its 8-row tiles; a
    row's output is the same alone as in a batch; the weights' own mm takes it for every row
    count (on AMX up to `vnni_amx_rows`), and the cost model sees no widening (on AMX from
    there)."""
    kernels = linear._vnni_kernels()
    if kernels is None:
        pytest.skip("no AVX512-VNNI or AVX2 kernel build here (CPU flag avx512_vnni or avx2)")
    n, k = shape
    q = quantize_int4(torch.from_numpy(_random(n, k, seed=group)), group)
    q.scale, q.zero = q.scale.to(ACT_DTYPE).float(), q.zero.to(ACT_DTYPE).float()
    w4 = Int4Weight(q)
    amx = linear._amx_kernels() is not None        # (many rows: the AMX test below)
    assert w4.vnni is not None and w4.packed is None
    assert linear.wide_from_rows("int4") == (Int4Weight.vnni_amx_rows if amx else None)
    n_pad = w4.padded_out
    for rows in (*range(1, 18), 64, 70):
        x = torch.randn(rows, k, dtype=ACT_DTYPE)
        y = torch.empty(rows, n_pad, dtype=ACT_DTYPE)
        kernels.int4_mm_vnni(x, w4.vnni, group, y)
        ref = _w4a8_reference(x, q)
        # float32 sums, then one bfloat16 rounding
        torch.testing.assert_close(y[:, :n].double(), ref, rtol=2 ** -8,
                                   atol=1e-5 * ref.abs().max().item())
        assert not y[:, n:].any()
        if not amx or rows < Int4Weight.vnni_amx_rows:
            assert torch.equal(w4.mm(x), y[:, :n])
        one = torch.empty(1, n_pad, dtype=ACT_DTYPE)
        kernels.int4_mm_vnni(x[-1:].contiguous(), w4.vnni, group, one)
        assert torch.equal(one[0], y[-1])


@pytest.mark.parametrize("shape,group", [((960, 576), 32), ((576, 1536), 32), ((64, 96), 32),
                                         ((960, 576), 64), ((40, 192), 64)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"g{v}")
def test_amx_widens_the_vnni_layout_to_torch_layouts_weights(shape, group):
    """On AMX, many rows of int4 weights in the VNNI layout are widened in cache and multiplied
    on the tiles (`int4vnni_mm_amx`): the same bf16 weights as torch's layout widened by
    `int4pack_mm_amx`, so the same bits as that kernel, for every remainder of its 16-row
    tiles and N padded to its 64 columns; the weights' own mm takes it from `vnni_amx_rows`."""
    kernels = linear._amx_kernels()
    if kernels is None or linear._vnni_kernels() is None or not linear.torch_int4_layout_is_ours():
        pytest.skip("no AMX here (CPU flags amx_tile amx_bf16, an AVX-512 kernel build)")
    n, k = shape
    q = quantize_int4(torch.from_numpy(_random(n, k, seed=n + group)), group)
    vnni, torch_layout = Int4Weight(q, vnni=True), Int4Weight(q, vnni=False)
    for rows in (1, 15, 16, 17, 33, 64, 100):
        x = torch.randn(rows, k, dtype=ACT_DTYPE)
        ours, theirs = (torch.empty(rows, vnni.padded_out, dtype=ACT_DTYPE) for _ in range(2))
        kernels.int4vnni_mm_amx(x, vnni.vnni, group, ours)
        kernels.int4pack_mm_amx(x, torch_layout.packed, torch_layout.scales_zeros, group, theirs)
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), (n, k, rows)
        assert ours.abs().sum() > 0
        if rows >= Int4Weight.vnni_amx_rows:
            assert torch.equal(vnni.mm(x), ours[:, :n])
    assert linear.wide_from_rows("int4") == Int4Weight.vnni_amx_rows


def test_the_avx2_build_multiplies_the_vnni_layout_to_the_same_bits():
    """The avx2 build's int4_mm_vnni (vpmaddubsw + vpmaddwd for each vpdpbusd) gives the
    AVX-512 build's result bit for bit: the integer sums are exact in both and the float
    steps the same, so a model answers alike on both kinds of CPU."""
    from gpu_worker.cpu_kernels import cpu_kernels
    from shared.cpu import cpu_flags
    if not {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags():
        pytest.skip("needs a CPU that runs both builds (AVX512-VNNI)")
    builds = [cpu_kernels(level) for level in ("avx512", "avx2")]
    if any(k is None or not hasattr(k, "int4_mm_vnni") for k in builds):
        pytest.skip("the avx2 and avx512 kernel builds")
    for (n, k), group in (((960, 576), 32), ((576, 1536), 32), ((64, 128), 64)):
        q = quantize_int4(torch.from_numpy(_random(n, k, seed=n)), group)
        w4 = Int4Weight(q, vnni=True)
        for rows in (1, 3, 4, 5, 8, 9, 17, 70):
            x = torch.randn(rows, k, dtype=ACT_DTYPE)
            ys = [torch.empty(rows, w4.padded_out, dtype=ACT_DTYPE) for _ in builds]
            for kernels, y in zip(builds, ys):
                kernels.int4_mm_vnni(x, w4.vnni, group, y)
            assert torch.equal(ys[0], ys[1]), (n, k, rows)
            assert ys[0].abs().sum() > 0


@pytest.mark.parametrize("shape", [(49152, 576), (960, 576), (48, 96), (16, 32)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_vnni_int8_gemm_is_its_8_bit_activations_times_the_weights(shape):
    """With AVX512-VNNI (no AMX) or AVX2 the int8 codes take the VNNI order and x is quantized
    to 8 bits per block of 32 (`int8_mm_vnni`): the result is that product up to float32 sums
    (and the bfloat16 output's rounding); float32 logits are those sums unrounded; a row's
    output is the same alone as in a batch; the weights' own mm and embedding take it."""
    kernels = linear._vnni_kernels()
    if kernels is None or linear._amx_kernels() is not None:
        pytest.skip("int8 codes keep their [N, K] order here (no AVX512-VNNI or AVX2 build, or AMX)")
    n, k = shape
    q = quantize_int8(torch.from_numpy(_random(n, k, seed=n)))
    q.scale = q.scale.to(ACT_DTYPE).float()
    w8 = Int8Weight(q)
    assert w8.vnni is not None and w8.codes is None
    assert linear.wide_from_rows("int8") is None
    for rows in (*range(1, 10), 17, 64, 70):
        x = torch.randn(rows, k, dtype=ACT_DTYPE)
        y32 = torch.empty(rows, n)
        kernels.int8_mm_vnni(x, w8.vnni, w8.scale, y32)
        ref = _w4a8_reference(x, q)
        torch.testing.assert_close(y32.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        assert torch.equal(w8.mm(x, torch.float32), y32)
        assert torch.equal(w8.mm(x), y32.to(ACT_DTYPE))
        one = torch.empty(1, n)
        kernels.int8_mm_vnni(x[-1:].contiguous(), w8.vnni, w8.scale, one)
        assert torch.equal(one[0], y32[-1])
    ids = torch.tensor([0, n - 1, n // 2, 5, 15, min(16, n - 1), min(17, n - 1)])
    assert torch.equal(w8.embedding(ids), q.dequantize()[ids])
    assert torch.equal(w8.embedding(ids[:4].view(2, 2)), q.dequantize()[ids[:4].view(2, 2)])


def test_the_avx2_build_multiplies_int8_codes_to_the_same_bits():
    """The avx2 build's int8_mm_vnni (c's sign moved onto x's codes, vpmaddubsw + vpmaddwd)
    gives the AVX-512 build's float32 logits bit for bit."""
    from gpu_worker.cpu_kernels import cpu_kernels
    from shared.cpu import cpu_flags
    if not {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags():
        pytest.skip("needs a CPU that runs both builds (AVX512-VNNI)")
    builds = [cpu_kernels(level) for level in ("avx512", "avx2")]
    if any(b is None or not hasattr(b, "int8_mm_vnni") for b in builds):
        pytest.skip("the avx2 and avx512 kernel builds")
    for n, k in ((49152, 576), (960, 576), (48, 96)):
        w8 = Int8Weight(quantize_int8(torch.from_numpy(_random(n, k, seed=k))), vnni=True)
        for rows in (1, 3, 4, 5, 8, 9, 70):
            x = torch.randn(rows, k, dtype=ACT_DTYPE)
            ys = [torch.empty(rows, n) for _ in builds]
            for kernels, y in zip(builds, ys):
                kernels.int8_mm_vnni(x, w8.vnni, w8.scale, y)
            assert torch.equal(ys[0], ys[1]), (n, k, rows)
            assert ys[0].abs().sum() > 0


@pytest.mark.parametrize("shape", [(49152, 576), (960, 576), (48, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", sorted(IN_CACHE))
def test_in_cache_int8_gemm_matches_its_dequantized_weights(shape, kind):
    """The int8 LM head on AMX (int8_mm_amx) and with vdpbf16ps (int8_mm_dpbf16): codes exact
    in bfloat16, the row scale applied to the float32 sums, so only the sums' order and the
    output's rounding separate it from x @ (c · s)ᵀ; rows in whole tiles and not."""
    available, why, threshold, tried = IN_CACHE[kind]
    if available() is None:
        pytest.skip(why)
    n, k = shape
    w8 = Int8Weight(quantize_int8(torch.from_numpy(_random(n, k))), vnni=False)
    for rows in (getattr(Int8Weight, threshold), *tried):
        x = torch.randn(rows, k, dtype=ACT_DTYPE)
        y = torch.empty(rows, n, dtype=ACT_DTYPE)
        getattr(available(), f"int8_mm_{kind}")(x, w8.codes, w8.scale, y)
        ref = x.float() @ (w8.codes.float() * w8.scale.float().unsqueeze(1)).t()
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
        if rows >= getattr(Int8Weight, threshold) and _chosen(kind):
            assert torch.equal(w8.mm(x), y)
        if kind == "dpbf16":    # float32 logits: the same sums, unrounded
            y32 = torch.empty(rows, n)
            available().int8_mm_dpbf16(x, w8.codes, w8.scale, y32)
            assert torch.equal(y32.to(ACT_DTYPE), y)
            one = torch.empty(1, n)                 # a row's logits whatever the batch
            available().int8_mm_dpbf16(x[-1:].contiguous(), w8.codes, w8.scale, one)
            assert torch.equal(one[0], y32[-1])
            if _chosen(kind) and rows <= Int8Weight.dpbf16_max_rows:
                assert torch.equal(w8.mm(x, torch.float32), y32)


def _fma_kernels():
    from gpu_worker.cpu_kernels import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None or not kernels.fma_ready():
        pytest.skip("no AVX2/FMA kernel build here")
    return kernels


@pytest.mark.parametrize("shape", MODEL_SHAPES[:4] + [(40, 64), (320, 192)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("group", [32, 64])
def test_fma_int4_gemm_multiplies_the_float_weights(shape, group, monkeypatch):
    """Without AMX or native bf16 (csrc/dequant.cpp int4pack_mm_fma), W is widened in cache to
    float32 and multiplied with FMA: x @ W in float32 up to the order of the sums and the
    output's bfloat16 rounding; row counts that fill the 6-row tiles and leave each remainder."""
    kernels = _fma_kernels()
    if not linear.torch_int4_layout_is_ours():
        pytest.skip("torch packs int4 for another CPU capability here; our kernels do not read it")
    n, k = shape
    q4 = quantize_int4(torch.from_numpy(_random(n, k, seed=group)), group)
    w4 = Int4Weight(q4, vnni=False)
    n_pad = w4.scales_zeros.shape[1]
    s, z = (w4.scales_zeros[..., i].float().t()[:n].repeat_interleave(group, dim=1)
            for i in (0, 1))
    w = (q4.codes.float() - 8) * s + z                 # the values the packed scales give
    monkeypatch.setattr(linear, "_amx_kernels", lambda: None)
    monkeypatch.setattr(linear, "_dpbf16_kernels", lambda: None)
    monkeypatch.setattr(linear, "_fma_kernels", lambda: kernels)
    for rows in range(1, 14):
        x = torch.randn(rows, k, dtype=ACT_DTYPE)
        y = torch.empty(rows, n_pad, dtype=ACT_DTYPE)
        kernels.int4pack_mm_fma(x, w4.packed, w4.scales_zeros, group, y)
        ref = x.float() @ w.t()
        torch.testing.assert_close(y[:, :n].float(), ref, rtol=2 ** -7,
                                   atol=1e-4 * ref.abs().max().item())
        assert not y[:, n:].any()
        if rows >= Int4Weight.fma_rows:
            assert torch.equal(w4.mm(x), y[:, :n])


@pytest.mark.parametrize("shape", [(49152, 576), (960, 576), (48, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fma_int8_gemm_matches_its_dequantized_weights(shape, monkeypatch):
    """The int8 LM head with FMA (int8_mm_fma): codes times their row's scale in float32,
    so only the sums' order and the output's rounding separate it from x @ (c · s)ᵀ."""
    kernels = _fma_kernels()
    n, k = shape
    w8 = Int8Weight(quantize_int8(torch.from_numpy(_random(n, k))), vnni=False)
    monkeypatch.setattr(linear, "_amx_kernels", lambda: None)
    monkeypatch.setattr(linear, "_dpbf16_kernels", lambda: None)
    monkeypatch.setattr(linear, "_fma_kernels", lambda: kernels)
    for rows in (Int8Weight.fma_rows, 13, 33):
        x = torch.randn(rows, k, dtype=ACT_DTYPE)
        y = w8.mm(x)
        ref = x.float() @ (w8.codes.float() * w8.scale.float().unsqueeze(1)).t()
        assert y.shape == (rows, n) and y.dtype == ACT_DTYPE
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-4 * ref.abs().max().item())


def test_quantization_error_is_what_the_scheme_allows():
    """Against the float weights: int4 within half a step of its group, int8 of its row."""
    w = torch.from_numpy(_random(256, 576))
    q4 = quantize_int4(w, 32)
    step4 = q4.scale.repeat_interleave(32, dim=1)
    assert ((q4.dequantize() - w).abs() <= step4 / 2 + 1e-5).all()
    q8 = quantize_int8(w)
    assert ((q8.dequantize() - w).abs() <= q8.scale / 2 + 1e-6).all()
    # a Q8_0 tensor asked for as int8 becomes per channel; a Q4 one as int8 too
    raw = quantize(w.numpy(), Q.Q8_0)
    per_channel = to_scheme(from_gguf(raw, Q.Q8_0, (256, 576)), "int8")
    assert per_channel.group == 576


# ---- choosing, and refusing ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("q") / "hf", hidden_size=64,
                            intermediate_size=128)


@pytest.mark.parametrize("qtype,want", [(Q.Q4_0, "int4"), (Q.Q4_1, "int4"), (Q.Q8_0, "int8"),
                                        (Q.F32, "none"), (Q.F16, "none")],
                         ids=lambda v: getattr(v, "name", v))
def test_auto_serves_a_gguf_in_its_own_precision(tmp_path, tiny_hf, qtype, want):
    source = resolve_model(write_tiny_gguf(tmp_path / "m.gguf", tiny_hf, qtype))
    assert resolve_quantization("auto", source, load_model_config(source)) == want


@pytest.mark.parametrize("types,want", [({}, "int4"), ({"blk.0.ffn_down.weight": Q.Q6_K}, "int8"),
                                        ({"blk.0.ffn_down.weight": Q.F16}, "none")])
def test_auto_serves_k_quants_as_their_widest_matrix(tmp_path, types, want):
    """Q4_K alone is int4; a Q6_K tensor beside it (as in a Q4_K_M file) makes it int8."""
    hf = write_tiny_llama(tmp_path / "wide", hidden_size=256, intermediate_size=256,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    source = resolve_model(write_tiny_gguf(tmp_path / "k.gguf", hf, Q.Q4_K, tensor_types=types))
    assert resolve_quantization("auto", source, load_model_config(source)) == want


def test_auto_serves_a_float_checkpoint_as_it_is_and_quantizes_when_asked(tiny_hf):
    source = resolve_model(tiny_hf)
    cfg = load_model_config(source)
    assert resolve_quantization("auto", source, cfg) == "none"
    assert resolve_quantization("int4", source, cfg) == "int4"
    assert resolve_quantization("int8", source, cfg) == "int8"
    with pytest.raises(PacerError, match="CPU only"):
        resolve_quantization("int4", source, cfg, device="cuda")
    assert resolve_quantization("auto", source, cfg, device="cuda") == "none"


def test_int4_refuses_shapes_that_do_not_divide_into_groups(tmp_path):
    odd = write_tiny_llama(tmp_path / "odd", hidden_size=48, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2)
    source = resolve_model(odd)
    cfg = load_model_config(source)
    with pytest.raises(PacerError, match=r"int4 .* groups of 32.*hidden_size = 48.*int8 or none"):
        resolve_quantization("int4", source, cfg)
    assert resolve_quantization("int8", source, cfg) == "int8"
    # a tp whose row-parallel shard cuts a group: 1536 / 9 heads... here 64 / tp=2 = 32 fits,
    # 128 / tp=4 = 32 fits, but 64 / tp=4 = 16 does not
    ok = resolve_model(write_tiny_llama(tmp_path / "ok", hidden_size=64, intermediate_size=128))
    with pytest.raises(PacerError, match="tp=4"):
        resolve_quantization("int4", ok, load_model_config(ok), tp=4)


def test_an_unknown_quantization_is_refused(tiny_hf):
    source = resolve_model(tiny_hf)
    with pytest.raises(PacerError, match="one of auto, none, int8, int4"):
        resolve_quantization("int3", source, load_model_config(source))


# ---- serving -------------------------------------------------------------------------------

def _greedy(model: str, prompts, tokens: int, **args) -> tuple[list[list], LLMEngine]:
    """Greedy SampledTokens (with the top-2 log-probabilities) of each prompt."""
    with LLMEngine(EngineArgs(model=model, block_size=16, num_kv_blocks=256,
                              max_model_len=512, **args), progress=False) as engine:
        out = engine.generate(prompts, [SamplingParams(max_tokens=tokens, temperature=0.0,
                                                       ignore_eos=True, logprobs=2)] * len(prompts))
        return [c.tokens for c in out], engine


# The GEMMs round their output to bfloat16 (gpu_worker/quant/linear.py): tp ranks round their
# partial sums where tp=1 rounds the whole, so two runs can part where the top two
# log-probabilities lie within bfloat16's rounding (2^-8 relative) of each other.
BF16_TIE = 0.02


def assert_same_greedy(ours: list, ref: list, what: str) -> None:
    """Token for token; a divergence only where the reference's top two were a bf16 near-tie."""
    ids, ref_ids = [t.token_id for t in ours], [t.token_id for t in ref]
    if ids == ref_ids:
        return
    i = next(k for k, (a, b) in enumerate(zip(ids, ref_ids)) if a != b)
    (_, first), (_, second) = ref[i].top_logprobs[:2]
    print(f"{what}: diverges at token {i}, top-2 log-probability gap {first - second:.2e}")
    assert first - second < BF16_TIE, f"{what}: token {i} differs, gap {first - second}"


PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
           list(range(60, 100))]


def test_a_quantized_model_holds_no_float_matrices(tmp_path, tiny_hf):
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf, Q.Q4_1)
    _, engine = _greedy(gguf, PROMPTS[:1], 2, dtype="float32")
    model = engine.runner.model
    assert engine.runner.quantization == "int4"
    for name, module in model.named_modules():
        if hasattr(module, "qweight") and hasattr(module, "weight"):
            assert module.qweight is not None and module.weight.numel() == 0, name
    assert model.layers[0].mlp.gate_up_proj.qweight.scheme == "int4"
    assert model.embed_tokens.qweight.scheme == "int8"


@pytest.mark.parametrize("model,quantization,kv", [("q4", "auto", "bfloat16"),
                                                   ("q4", "none", "float32"),
                                                   ("hf", "int8", "bfloat16"),
                                                   ("hf", "auto", "float32")])
def test_quantized_weights_keep_a_bfloat16_kv_cache_whatever_the_dtype(tmp_path, tiny_hf, model,
                                                                       quantization, kv):
    """The pool the layout sizes is the pool the runner allocates: same dtype, same bytes."""
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf, Q.Q4_1) if model == "q4" else tiny_hf
    with LLMEngine(EngineArgs(model=path, block_size=16, max_model_len=512, dtype="float32",
                              quantization=quantization, kv_cache_memory="1MiB"),
                   progress=False) as engine:
        pool, blocks = engine.runner.kv_pool, engine.scheduler.config.num_kv_blocks
        assert pool.dtype == getattr(torch, kv)
        assert pool.shape[2] == blocks
        nbytes = pool.numel() * pool.element_size()
        assert nbytes <= 1 << 20 < nbytes + nbytes // blocks


@pytest.mark.parametrize("qtype,wide_from", [(Q.Q4_1, Int4Weight.wide_from()), (None, None)])
def test_the_worker_tells_the_cost_model_where_its_gemms_widen(tmp_path, tiny_hf, qtype, wide_from):
    """The widening threshold reaches the online cost model with the step results
    (shared/online_cost.py); a float model has none."""
    model = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf, qtype) if qtype else tiny_hf
    _, engine = _greedy(model, PROMPTS, 2, dtype="float32", target_tbt_ms="auto")
    cost = engine.scheduler.config.iteration_cost
    assert cost.observations > 0 and cost.wide_from_rows == wide_from
    if wide_from is None:
        assert cost.coefficients_ms["widen_ms"] == cost.coefficients_ms["per_narrow_row_ms"] == 0


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_tp3_quantized_gives_tp1_tokens(tmp_path, quantization):
    """6 query heads, 3 KV heads, hidden 96, intermediate 192: each rank holds 2 heads (32
    columns of o_proj: one int4 group) and 64 columns of down_proj; from a Q4_0 GGUF."""
    hf = write_tiny_llama(tmp_path / "six", seed=2, hidden_size=96, intermediate_size=192,
                          num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2)
    gguf = write_tiny_gguf(tmp_path / "six.gguf", hf, Q.Q4_0)
    args = dict(dtype="float32", quantization=quantization, max_num_batched_tokens=16)
    single, engine = _greedy(gguf, PROMPTS, 12, tp=1, **args)
    assert engine.runner.quantization == quantization
    three, _ = _greedy(gguf, PROMPTS, 12, tp=3, **args)
    for k, (o, s) in enumerate(zip(three, single)):
        assert_same_greedy(o, s, f"tp=3 {quantization} prompt {k} vs tp=1")


def test_few_rows_run_on_one_thread_fewer(tmp_path, tiny_hf, monkeypatch):
    """CPU, quantized: the forward of an iteration of at most FEW_ROWS rows runs on one torch
    thread fewer than the worker has (a core left to the services beside it), a larger one on
    all of them, and the count is the worker's again after it; the tokens are those of a
    runner that never changes its thread count."""
    import gpu_worker.model_runner as model_runner
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf, Q.Q4_1)
    before = torch.get_num_threads()
    seen: list[tuple[int, int]] = []
    logits = model_runner.ModelRunner._logits

    def watched(self, input_ids, *rest):
        seen.append((len(input_ids), torch.get_num_threads()))
        return logits(self, input_ids, *rest)

    def run() -> list[list[int]]:
        one, _ = _greedy(gguf, PROMPTS[:1], 6)        # a prefill, then one decode at a time
        three, _ = _greedy(gguf, PROMPTS[:3], 4)      # three decodes at a time
        assert torch.get_num_threads() == 3
        return [[t.token_id for t in c] for c in one + three]
    try:
        torch.set_num_threads(3)
        monkeypatch.setattr(model_runner.ModelRunner, "_logits", watched)
        varied = run()
        first, few = list(seen), model_runner.FEW_ROWS
        monkeypatch.setattr(model_runner, "FEW_ROWS", 0)
        fixed = run()
    finally:
        torch.set_num_threads(before)
    assert few >= 1 and (1, 2) in first and (3, 3) in first
    assert all(threads == (2 if rows <= few else 3) for rows, threads in first)
    assert all(threads == 3 for _, threads in seen[len(first):])
    assert varied == fixed


@pytest.mark.parametrize("level,warned", [("generic", True), ("avx2", False)])
def test_integer_weights_on_a_cpu_without_avx2_are_warned_of(tmp_path, tiny_hf, monkeypatch,
                                                               level, warned):
    """Below AVX2 torch's int4/int8 GEMMs run their baseline code, 5-80x slower than float32
    weights (measured held to generic): serving a GGUF in its own precision there says so,
    naming the flag that widens it."""
    from structlog.testing import capture_logs
    monkeypatch.setenv("PACER_CPU_ISA", level)
    source = resolve_model(write_tiny_gguf(tmp_path / "m.gguf", tiny_hf, Q.Q4_0))
    with capture_logs() as logs:
        assert resolve_quantization("auto", source, load_model_config(source)) == "int4"
    said = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert bool(said) == warned and all("--quantization none" in e for e in said)


def test_a_seeded_request_on_an_int8_lm_head_ignores_the_batch(tmp_path, tiny_hf):
    """A quantized model's LM head is int8 (its embedding's rows are looked up), here over a
    vocabulary of 287, no multiple of 16: a seeded request's tokens and log-probabilities,
    bit for bit, are the same alone and beside 15 other requests (16 rows: the LM head once
    took another kernel from there on)."""
    if linear._vnni_kernels() is None or linear._amx_kernels() is not None:
        pytest.skip("int8 codes keep their [N, K] order here (no AVX512-VNNI or AVX2 build, "
                    "or AMX, whose tiles are not batch-invariant)")
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf, Q.Q4_1)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=42, ignore_eos=True, logprobs=0)
    others = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def first_of(prompts) -> list[tuple[int, float]]:
        with LLMEngine(EngineArgs(model=gguf, block_size=16, num_kv_blocks=256,
                                  max_model_len=512, dtype="float32"), progress=False) as engine:
            assert engine.runner.model.lm_head.qweight.out_features == 287
            out = engine.generate(prompts, [seeded] + [others] * (len(prompts) - 1))
            return [(t.token_id, t.logprob) for t in out[0].tokens]
    assert first_of(PROMPTS[2:]) == first_of(PROMPTS[2:] + PROMPTS * 5)
