"""A quantized matrix as the checkpoint ships it: integer codes plus group-wise scales.

Two schemes, both along the input dimension K in groups of `group` columns:

    int4: w[n, k] = (c[n, k] - 8) · scale[n, g] + zero[n, g]    c in 0..15 (uint8, unpacked)
    int8: w[n, k] =  c[n, k]      · scale[n, g]                  c in -127..127 (int8)

with g = k // group. GGUF's blocks map onto them exactly (the codes are the file's, the scales
the file's fp16 values widened to float32):

    Q4_0  w = (q - 8) · d            -> int4, scale d, zero 0
    Q4_1  w =  q · d + m             -> int4, scale d, zero m + 8·d
    Q4_K  w =  q · d·sc_j - dmin·m_j -> int4, scale d·sc_j, zero 8·d·sc_j - dmin·m_j: each
                                        256-value super-block is eight groups of 32, each
                                        with 6-bit sc_j and m_j against its fp16 d and dmin
    Q8_0  w =  q · d                 -> int8, scale d (group 32)

The other k-quants (Q2_K, Q3_K, Q5_K, Q6_K) and Q5_0/Q5_1 have no such map: the loader widens
them to float (gguf-py's dequantize) and the layers quantize them to the model's scheme.

A QTensor is what the loader hands the layers (`gpu_worker/weights.py` with quantized=True);
the layers cut it on head boundaries (rows) or on group boundaries (columns) for tensor
parallelism, then pack it once (`gpu_worker/quant/linear.py`). Nothing here builds a float
copy of a whole tensor except `dequantize`, the reference, and the requantizations a user asks
for (`--quantization int8` of a Q4 file, or of a float checkpoint), one tensor at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
QK = 32                                       # GGUF's block size for Q4_0, Q4_1, Q8_0
GGUF_QUANT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0)   # loaded as codes and scales
QK_K = 256                                    # a k-quant super-block
SCHEMES = ("int4", "int8")
INT4_GROUPS = (32, 64, 128, 256)              # what torch's int4 CPU kernel takes


@dataclass
class QTensor:
    scheme: str                  # "int4" or "int8"
    codes: torch.Tensor          # [N, K]: uint8 0..15 (int4) or int8 (int8)
    scale: torch.Tensor          # [N, K // group] float32
    zero: torch.Tensor | None    # [N, K // group] float32 (int4 only)
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these codes stand for (the reference; tests, `none`)."""
        n, k = self.shape
        c = self.codes.to(torch.float32).view(n, k // self.group, self.group)
        s = self.scale.unsqueeze(-1)
        w = (c - 8.0) * s + self.zero.unsqueeze(-1) if self.scheme == "int4" else c * s
        return w.reshape(n, k)

    def rows(self, start: int, n: int) -> "QTensor":
        return QTensor(self.scheme, self.codes.narrow(0, start, n), self.scale.narrow(0, start, n),
                       None if self.zero is None else self.zero.narrow(0, start, n), self.group)

    def cols(self, start: int, n: int) -> "QTensor":
        """Columns [start, start + n): both ends must fall on group boundaries (the row-parallel
        shard of a tensor-parallel rank; the caller checks and says which). One group per row
        (int8 per channel) keeps its scale: any cut of the row falls inside it."""
        if self.group == self.shape[1]:
            return QTensor(self.scheme, self.codes.narrow(1, start, n), self.scale, self.zero, n)
        assert start % self.group == 0 and n % self.group == 0, (start, n, self.group)
        g0, gn = start // self.group, n // self.group
        return QTensor(self.scheme, self.codes.narrow(1, start, n), self.scale.narrow(1, g0, gn),
                       None if self.zero is None else self.zero.narrow(1, g0, gn), self.group)

    def permute_rows(self, order: torch.Tensor) -> "QTensor":
        return QTensor(self.scheme, self.codes[order], self.scale[order],
                       None if self.zero is None else self.zero[order], self.group)


def cat_rows(parts: list[QTensor]) -> QTensor:
    first = parts[0]
    assert all(p.scheme == first.scheme and p.group == first.group for p in parts)
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])
    return QTensor(first.scheme, torch.cat([p.codes for p in parts]),
                   torch.cat([p.scale for p in parts]), zero, first.group)


# ---- from GGUF blocks ---------------------------------------------------------------------

def from_gguf(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QTensor:
    """A Q4_0, Q4_1, Q4_K or Q8_0 tensor's raw bytes (GGUFReader's `data`: [rows, bytes per
    row]) as codes and scales, vectorized, without a float copy of the weights."""
    n, k = shape
    if qtype == Q.Q4_K:
        return _from_q4_k(np.ascontiguousarray(data).reshape(n, k // QK_K, -1), n, k)
    blocks = np.ascontiguousarray(data).reshape(n, k // QK, -1)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == Q.Q8_0:
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
        return QTensor("int8", codes, d, None, QK)
    if qtype == Q.Q4_0:
        qs, zero = blocks[..., 2:], torch.zeros_like(d)
    elif qtype == Q.Q4_1:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        qs, zero = blocks[..., 4:], m + 8.0 * d
    else:
        raise ValueError(f"{qtype.name} is not a GGUF type that loads quantized")
    # byte j of a block holds element j (low nibble) and element j + 16 (high nibble)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return QTensor("int4", torch.from_numpy(codes), d, zero, QK)


def _from_q4_k(blocks: np.ndarray, n: int, k: int) -> QTensor:
    """Q4_K super-blocks [n, k / 256, 144 bytes]: fp16 d, fp16 dmin, 12 bytes of eight 6-bit
    scales and eight 6-bit mins, 128 bytes of 4-bit codes."""
    def f16(lo: int) -> np.ndarray:
        return blocks[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    d, dmin = f16(0), f16(2)
    packed = blocks[..., 4:16]
    # bytes 0-3: scales 0-3 (low 6 bits), 4-7: mins 0-3 (low 6 bits); 8-11: scales 4-7 (low
    # nibble) and mins 4-7 (high nibble), whose two high bits are the top bits of 0-3 and 4-7
    low, mid, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (top & 15) | ((low >> 6) << 4)], axis=-1).astype(np.float32)
    mn = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1).astype(np.float32)
    scale = d[..., None] * sc                                   # [n, k / 256, 8]
    zero = 8.0 * scale - dmin[..., None] * mn
    # 32 bytes per pair of groups: group 2i in their low nibbles, group 2i + 1 in the high
    qs = blocks[..., 16:].reshape(n, k // QK_K, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(n, k)
    return QTensor("int4", torch.from_numpy(codes), torch.from_numpy(scale.reshape(n, -1)),
                   torch.from_numpy(zero.reshape(n, -1)), QK)


# ---- quantizing float weights, and converting between schemes ------------------------------

def quantize_int8(w: torch.Tensor) -> QTensor:
    """Symmetric int8 per output channel (one group spanning K): what torch's
    `_weight_int8pack_mm` takes."""
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return QTensor("int8", codes, scale, None, w.shape[1])


def quantize_int4(w: torch.Tensor, group: int) -> QTensor:
    """Asymmetric int4 in groups of `group` columns (min/max per group), gpt-fast's scheme:
    w ≈ (c - 8) · scale + zero."""
    w = w.to(torch.float32)
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    codes = torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15)
    return QTensor("int4", codes.to(torch.uint8).reshape(n, k), scale, lo + 8.0 * scale, group)


def to_scheme(t: QTensor | torch.Tensor, scheme: str, group: int = QK) -> QTensor:
    """`t` (a float tensor or a QTensor) in `scheme`; as is when it already is, else quantized
    from its float values (one tensor at a time). int8 becomes per-channel here: the kernel's
    layout."""
    if isinstance(t, QTensor):
        if t.scheme == scheme and (scheme == "int4" or t.group == t.shape[1]):
            return t
        t = t.dequantize()
    return quantize_int8(t) if scheme == "int8" else quantize_int4(t, group)
