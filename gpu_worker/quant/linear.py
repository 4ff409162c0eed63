"""Packed quantized weights and their GEMMs on CPU: y = x Wᵀ with W held as integers.

    Int4Weight  torch's int4 CPU layout (`_convert_weight_to_int4pack_for_cpu`: two codes a
                byte) with group-wise (scale, zero) pairs [K / group, N, 2];
                `_weight_int4pack_mm_for_cpu`
    Int8Weight  int8 [N, K] with one scale per output channel; `_weight_int8pack_mm`; also the
                embedding table (rows looked up and widened)

Both take bfloat16 activations (measured on the AVX-512 machine, 2 threads: with float32
activations these kernels are 10-30x slower; float16 ones 50x) and return bfloat16; the
caller casts at the edge (gpu_worker/model/layers.py `_matmul`). The scales are stored in
bfloat16 too (the kernels ask for the activations' dtype). N is padded to a multiple of 64
for the int4 layout; the padding rows are zero and cut from the output.

Chosen by rows: torch's kernels are built for a few rows (decodes) and read 4x (int4) or 2x
(int8) fewer bytes than bfloat16 there; from `many_rows` rows on (prefill chunks, many
decodes) the weight is widened to bfloat16 for that one GEMM by the CPU kernels (csrc/
dequant.cpp) and multiplied by torch's bfloat16 GEMM (oneDNN: AMX or AVX512-BF16), which wins
by more than the widening costs. Without the CPU kernels, torch's kernels serve every size.
On a CPU without native bf16 dot products (AVX2 only: a bf16 GEMM there widens to float32 in
software, 8x slower) the widened weight is multiplied in float32 instead. On a CPU with AMX the
int4 weights skip that round trip: from `amx_rows` rows on, the kernel widens 64 columns at a
time into cache and multiplies them there on the tile unit (csrc/dequant.cpp
`int4pack_mm_amx`; docs/benchmarks.md#quantized-weights has the figures). With AVX512-BF16 but
no AMX the same widening feeds `vdpbf16ps` instead (`int4pack_mm_dpbf16`, `int8_mm_dpbf16`,
from `dpbf16_rows`). Without AMX or native bf16 GEMMs (AVX2 CPUs), from `fma_rows` rows on,
kernels of the same shape widen to float32 in cache and multiply with FMA (`int4pack_mm_fma`,
`int8_mm_fma`): no widened weight in memory, no bf16 detour.

With AVX512-VNNI (AMX or not) and on AVX2 CPUs, int4 weights take none of those paths: their
codes are kept in a layout of their own (`int4_vnni_layout`, instead of torch's) and every row
count runs `int4_mm_vnni` (csrc/int4_vnni.cpp), x quantized to 8 bits per block of 32 and
multiplied with integer dot products (`vpdpbusd`; on AVX2 `vpmaddubsw` + `vpmaddwd`, the same bits),
as llama.cpp serves a Q4 file (PACER_INT4_VNNI=0 declines it); a row's output depends on that
row alone. On AMX, from `vnni_amx_rows` rows on, the VNNI layout is widened in cache and
multiplied on the tiles as torch's is (`int4vnni_mm_amx`: the same bf16 weights, the same
sums as `int4pack_mm_amx`).
"""
from __future__ import annotations

import functools
import os

import torch

from gpu_worker.cpu_kernels import best_level, cpu_kernels
from gpu_worker.quant.tensor import QTensor
from shared.cpu import cpu_flags, native_bf16

AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})

ACT_DTYPE = torch.bfloat16


def _widening_kernels():
    kernels = cpu_kernels()
    return kernels if kernels is not None and hasattr(kernels, "dequantize_int4pack") else None


@functools.cache
def torch_int4_layout_is_ours() -> bool:
    """Whether torch's CPU int4 layout here is the one our kernels read (csrc/dequant.cpp's
    widening, AMX, AVX512-BF16 and FMA kernels). torch packs by its own CPU capability, and its
    AVX2 packing is not the AVX-512 one those kernels were written for: on an AVX2 CPU they
    would read wrong codes, so there torch's own int4 kernel serves weights in torch's layout
    at every size. Probed once: a known matrix packed by torch, widened back by ours."""
    kernels = _widening_kernels()
    if kernels is None:
        return False
    n, k, group = 64, 64, 32
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    ones = torch.ones(k // group, n)
    scales_zeros = torch.stack([ones, torch.zeros_like(ones)], dim=-1).to(ACT_DTYPE)
    w_t = torch.empty(k, n, dtype=ACT_DTYPE)
    kernels.dequantize_int4pack(packed, scales_zeros, group, w_t)
    return torch.equal(w_t.t().float(), codes.float() - 8)


@functools.cache
def _amx_kernels():
    """The CPU kernels when they run int4 GEMMs on AMX tiles here: an AVX-512 build not held
    lower (PACER_CPU_ISA), a CPU with AMX-BF16, and the OS's leave (`amx_ready`)."""
    kernels = _widening_kernels()
    if (kernels is None or not hasattr(kernels, "amx_ready") or best_level() != "avx512"
            or not AMX_FLAGS <= cpu_flags()):
        return None
    return kernels if kernels.amx_ready() else None


@functools.cache
def _dpbf16_kernels():
    """The CPU kernels when they run int4 and int8 GEMMs with AVX512-BF16's dot products here:
    an AVX-512 build not held lower and a CPU with AVX512-BF16 (AMX, where there is some, comes
    first: `_in_cache_kernels`)."""
    kernels = _widening_kernels()
    if (kernels is None or not hasattr(kernels, "dpbf16_ready") or best_level() != "avx512"
            or "avx512_bf16" not in cpu_flags() or not kernels.dpbf16_ready()):
        return None
    return kernels


@functools.cache
def _vnni_kernels():
    """The CPU kernels when int4 weights are kept in the VNNI layout and every int4 GEMM runs
    `int4_mm_vnni` (8-bit activations): an AVX-512 build on a CPU with AVX512-VNNI, or the
    avx2 build (it beat torch's int4 kernel and the FMA path at every row count, and the AMX
    tile kernels up to `vnni_amx_rows` rows, from which AMX CPUs widen the VNNI layout into
    cache for the tiles instead: `int4vnni_mm_amx`, docs/benchmarks.md).
    PACER_INT4_VNNI=0 keeps bfloat16 activations instead (perplexity +0.15 % over float32's
    rather than +0.37 %, at a cost in speed: docs/benchmarks.md#quantized-weights)."""
    kernels = _widening_kernels()
    if kernels is None or not hasattr(kernels, "vnni_ready") or \
            os.environ.get("PACER_INT4_VNNI", "1") == "0":
        return None
    level = best_level()
    if level == "avx512" and "avx512_vnni" not in cpu_flags():
        return None
    return kernels if level in ("avx512", "avx2") and kernels.vnni_ready() else None


def vnni_tiles_from_rows() -> int:
    """The row count from which int4 GEMMs in the VNNI layout take the AMX tiles here
    (`int4vnni_mm_amx`), or -1 where they never do (no AMX): Int4Weight.mm's rule, and the
    kernels' DecoderStack's, so that both paths give a row the same bits."""
    return Int4Weight.vnni_amx_rows if _amx_kernels() is not None else -1


def int4_vnni_layout(codes: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """int4 codes [N, K] (uint8 0..15; N a multiple of 16, K of the group, the group of 32)
    and their (scale, zero) pairs [K / group, N, 2] (bfloat16) in the layout of
    csrc/int4_vnni.cpp: [N / 16, K / group, 64 + 8·group] bytes, per 16 columns and group its
    16 pairs, then per 32 k four 64-byte vectors, byte 4c + i of vector p holding column c's
    codes for k = 4p + i (low nibble) and k = 16 + 4p + i (high nibble)."""
    n, k = codes.shape
    c = codes.view(n // 16, 16, k // 32, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    packed = (c[..., 0] | (c[..., 1] << 4)).contiguous().view(n // 16, k // group, 8 * group)
    pairs = scales_zeros.view(k // group, n // 16, 16 * 2).transpose(0, 1).contiguous()
    return torch.cat([pairs.view(torch.uint8), packed], dim=-1)


@functools.cache
def _fma_kernels():
    """The CPU kernels when many-row GEMMs widen to float32 in cache and multiply with FMA
    here: a build with those kernels (AVX2 and above) on a CPU without native bf16 GEMMs, where
    the other paths would widen the weight to memory."""
    kernels = _widening_kernels()
    if (kernels is None or not hasattr(kernels, "fma_ready") or not kernels.fma_ready()
            or _bf16_gemm_native()):
        return None
    return kernels


def _in_cache_kernels():
    """(kernels, kind) of the GEMMs that widen in cache here, the best this CPU has: "amx",
    "dpbf16" or "fma"; (None, None) where none does. (Not cached itself: tests hold each
    kind's finder to None to take the next.)"""
    for kind, find in (("amx", _amx_kernels), ("dpbf16", _dpbf16_kernels),
                       ("fma", _fma_kernels)):
        kernels = find()
        if kernels is not None:
            return kernels, kind
    return None, None


@functools.cache
def _bf16_gemm_native() -> bool:
    """bf16 GEMMs in hardware: the CPU has AVX512-BF16 or AMX and its kernels are not held below
    AVX-512 (PACER_CPU_ISA, gpu_worker/cpu_kernels.py; `--dtype auto` decides by the same)."""
    return native_bf16() and best_level() == "avx512"


def _mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w for a widened bf16 weight: in bf16 where that is native, else in float32."""
    if _bf16_gemm_native():
        return torch.mm(x, w, out=out)
    y = torch.mm(x.float(), w.float()).to(ACT_DTYPE)
    return y if out is None else out.copy_(y)


class _Packed:
    many_rows: int          # from this many rows on, widen the weight (to bf16 in memory)
    amx_rows: int           # with AMX, from this many rows on: the tile kernels
    fma_rows: int           # without AMX or native bf16, from this many rows on: FMA in cache
    dpbf16_rows: int        # AVX512-BF16 without AMX, from this many rows on: vdpbf16ps in cache
    dpbf16_max_rows: int | None = None     # ...up to this many (beyond: widened to memory)

    @classmethod
    def _kernels_read_layout(cls) -> bool:
        """Whether our widening kernels read this scheme's packed layout here."""
        return True

    @classmethod
    def wide_from(cls) -> int | None:
        """The row count from which these GEMMs widen the weight (in cache or to a bf16 copy),
        here; None without the CPU kernels."""
        if not cls._kernels_read_layout():
            return None
        kernels, kind = _in_cache_kernels()
        if kernels is not None:
            return getattr(cls, f"{kind}_rows")
        return cls.many_rows if _widening_kernels() is not None else None

    def _in_cache(self, rows: int):
        """The kernels that widen this weight in cache for `rows` rows, and their kind (the
        suffix of `int4pack_mm_amx`, `int8_mm_fma`, ...), or (None, None)."""
        kernels, kind = _in_cache_kernels() if self._kernels_read_layout() else (None, None)
        if kernels is None or rows < getattr(self, f"{kind}_rows") or \
                kind == "dpbf16" and self.dpbf16_max_rows is not None \
                and rows > self.dpbf16_max_rows:
            return None, None
        return kernels, kind

    def _widening(self, rows: int):
        """The kernels that widen this weight to memory for `rows` rows, or None."""
        return _widening_kernels() if rows >= self.many_rows and self._kernels_read_layout() \
            else None


class Int4Weight(_Packed):
    scheme = "int4"
    many_rows = 24          # measured: docs/benchmarks.md#quantized-weights
    amx_rows = 10
    fma_rows = 8
    dpbf16_rows = 10
    vnni_amx_rows = 40      # the VNNI layout on AMX: from this many rows on, the tiles

    def __init__(self, q: QTensor, vnni: bool | None = None):
        """`vnni`: keep the codes in the VNNI layout (`int4_vnni_layout`) instead of torch's,
        and multiply every row count with `int4_mm_vnni`; None: where `_vnni_kernels` says."""
        assert q.scheme == "int4"
        n, k = q.shape
        self.out_features, self.in_features, self.group = n, k, q.group
        pad = -n % 64
        codes, scale, zero = q.codes, q.scale, q.zero
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, k)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        if vnni is None:        # (the groups are 32-256 wide and divide K: torch's layout's rule)
            vnni = _vnni_kernels() is not None
        scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(ACT_DTYPE).contiguous()
        self.padded_out = n + pad
        # the VNNI layout holds the scales beside the codes; torch's keeps them apart
        self.vnni = int4_vnni_layout(codes.contiguous(), scales_zeros, q.group) if vnni else None
        self.packed = None if vnni else torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1)
        self.scales_zeros = None if vnni else scales_zeros

    @classmethod
    def wide_from(cls) -> int | None:
        """Where the weights take the VNNI layout: None (int4_mm_vnni for every row count,
        nothing widened), or with AMX `vnni_amx_rows`."""
        if _vnni_kernels() is None:
            return super().wide_from()
        tiles_from = vnni_tiles_from_rows()
        return tiles_from if tiles_from >= 0 else None

    @classmethod
    def _kernels_read_layout(cls) -> bool:
        return torch_int4_layout_is_ours()

    @property
    def nbytes(self) -> int:
        if self.vnni is not None:
            return self.vnni.nbytes
        return self.packed.nbytes + self.scales_zeros.nbytes

    def mm(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x Wᵀ in bfloat16 (`out_dtype` is the caller's to cast to)."""
        x = x if x.dtype == ACT_DTYPE else x.to(ACT_DTYPE)
        rows = x.shape[0]
        tiles, suffix = (None, None) if self.vnni is not None else self._in_cache(rows)
        kernels = self._widening(rows) if tiles is None and self.vnni is None else None
        if self.vnni is not None:
            y = x.new_empty((rows, self.padded_out))
            if 0 <= vnni_tiles_from_rows() <= rows:
                _amx_kernels().int4vnni_mm_amx(x.contiguous(), self.vnni, self.group, y)
            else:
                _vnni_kernels().int4_mm_vnni(x.contiguous(), self.vnni, self.group, y)
        elif tiles is not None:
            y = x.new_empty((rows, self.padded_out))
            getattr(tiles, f"int4pack_mm_{suffix}")(x.contiguous(), self.packed,
                                                     self.scales_zeros, self.group, y)
        elif kernels is not None:
            w_t = x.new_empty((self.in_features, self.padded_out))
            kernels.dequantize_int4pack(self.packed, self.scales_zeros, self.group, w_t)
            y = _mm(x, w_t)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                           self.scales_zeros)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features].contiguous()


def int8_vnni_layout(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (N a multiple of 16, K of 4) in the order of csrc/int4_vnni.cpp's
    int8 product: [N / 16, K / 4, 16, 4], one 64-byte vector per 16 columns and 4 k."""
    n, k = codes.shape
    return codes.view(n // 16, 16, k // 4, 4).transpose(1, 2).contiguous()


def _int8_vnni() -> bool:
    """Whether int8 weights take the VNNI order here and `int8_mm_vnni` serves every row
    count: where int4 weights take `int4_mm_vnni`, but not on AMX CPUs, whose tile kernels
    read the codes as they are (measured there: docs/benchmarks.md#quantized-weights)."""
    return _vnni_kernels() is not None and _amx_kernels() is None


class Int8Weight(_Packed):
    scheme = "int8"
    many_rows = 16          # measured: docs/benchmarks.md#quantized-weights
    amx_rows = 5
    fma_rows = 16
    dpbf16_rows = 1         # at one row too: 1.5 ms for the LM head against torch's 1.9
    dpbf16_max_rows = 48    # its transposed sums lose to widening from 64 rows (13 vs 12 ms)
    CHUNK = 4096

    def __init__(self, q: QTensor, vnni: bool | None = None):
        """`vnni`: keep the codes in the VNNI order (`int8_vnni_layout`) instead of [N, K]
        and multiply every row count with `int8_mm_vnni` (x quantized to 8 bits per block of
        32, as for int4); None: where `_int8_vnni` says and the shape allows."""
        assert q.scheme == "int8" and q.group == q.shape[1], "int8 packs per output channel"
        self.out_features, self.in_features = n, k = q.shape
        self.tile_shape = n % 16 == 0 and k % 32 == 0
        if vnni is None:
            vnni = k % 32 == 0 and _int8_vnni()
        codes, scale = q.codes, q.scale.reshape(-1)
        # the VNNI order takes output channels 16 at a time: a vocabulary that is no multiple
        # of 16 gets zero channels (cut from the output), not another kernel, whose sums
        # differ: every row count takes int8_mm_vnni, so a row's logits are the same in any
        # batch (a seeded request's tokens too)
        self.padded_out = n + (-n % 16 if vnni else 0)
        if self.padded_out != n:
            codes = torch.cat([codes, codes.new_zeros(self.padded_out - n, k)])
            scale = torch.cat([scale, scale.new_ones(self.padded_out - n)])
        self.scale_f32 = scale.contiguous()
        self.scale = self.scale_f32.to(ACT_DTYPE)
        self.vnni = int8_vnni_layout(codes) if vnni else None
        self.codes = None if vnni else codes.contiguous()

    @classmethod
    def wide_from(cls) -> int | None:
        """None where the codes take the VNNI order (nothing widened at any row count)."""
        return None if _int8_vnni() else super().wide_from()

    @property
    def nbytes(self) -> int:
        codes = self.vnni if self.vnni is not None else self.codes
        return codes.nbytes + self.scale_f32.nbytes + self.scale.nbytes

    def mm(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x Wᵀ in bfloat16, or in float32 where `out_dtype` asks it and the kernel can write
        it (with AVX512-BF16 or the VNNI order: the LM head's logits, unrounded, no copy)."""
        x = x if x.dtype == ACT_DTYPE else x.to(ACT_DTYPE)
        rows = x.shape[0]
        if self.vnni is not None:
            y = x.new_empty((rows, self.padded_out),
                            dtype=torch.float32 if out_dtype == torch.float32 else ACT_DTYPE)
            _vnni_kernels().int8_mm_vnni(x.contiguous(), self.vnni, self.scale, y)
            return y if self.padded_out == self.out_features else \
                y[:, :self.out_features].contiguous()
        tiles, suffix = self._in_cache(rows) if self.tile_shape else (None, None)
        if tiles is not None:
            wide = out_dtype == torch.float32 and suffix == "dpbf16"
            y = x.new_empty((rows, self.out_features), dtype=torch.float32 if wide else ACT_DTYPE)
            getattr(tiles, f"int8_mm_{suffix}")(x.contiguous(), self.codes, self.scale, y)
            return y
        kernels = self._widening(rows)
        if kernels is None:
            return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)
        # widened CHUNK rows at a time: a whole LM head in bfloat16 (56 MB for SmolLM2) would
        # be a fresh mapping, page-faulted in on every call; a few MB are reused from the heap
        y = x.new_empty((x.shape[0], self.out_features))
        w = x.new_empty((min(self.CHUNK, self.out_features), self.in_features))
        for n0 in range(0, self.out_features, self.CHUNK):
            n = min(self.CHUNK, self.out_features - n0)
            kernels.dequantize_int8(self.codes[n0:n0 + n], self.scale[n0:n0 + n], w[:n])
            _mm(x, w[:n].t(), out=y[:, n0:n0 + n])
        return y

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` widened to float32: codes · scale, the values `mm` multiplies by."""
        if self.vnni is None:
            codes = self.codes[ids]
        else:   # a row's 4-byte groups, read as int32: a quarter of the elements to gather
            words = self.vnni.view(torch.int32).view(self.vnni.shape[:3])
            codes = words[ids.div(16, rounding_mode="floor"), :, ids.remainder(16)] \
                .view(torch.int8).reshape(*ids.shape, self.in_features)
        return codes.to(torch.float32) * self.scale_f32[ids].unsqueeze(-1)


def wide_from_rows(scheme: str) -> int | None:
    """The row count from which the layer GEMMs of `scheme` widen their weights (a cost per
    GEMM, whatever the rows: what the scheduler's cost model prices per iteration,
    shared/online_cost.py); None where every size takes one path."""
    if scheme not in ("int4", "int8"):
        return None
    return (Int4Weight if scheme == "int4" else Int8Weight).wide_from()


def pack(q: QTensor) -> Int4Weight | Int8Weight:
    return Int4Weight(q) if q.scheme == "int4" else Int8Weight(q)
