"""Our own Triton kernel for varlen chunks over the paged KV cache: fresh prefills, later
chunks over a cached prefix and decodes in one launch, any block size, GQA.

One program attends one tile of query rows of one request against one KV head: the tile holds
BLOCK_Q query rows times all GROUP query heads that share the KV head (rows packed as
`q_row * GROUP_P + head_in_group`), so every K/V element is read once per tile rather than
once per query head — for a decode, one read of the request's cache per KV head. Keys are
walked in tiles of BLOCK_N token slots; each slot is found through the block table
(`block_table[pos // block_size]`), so a tile may span pages and any block size works.
Softmax is the online (flash) form in float32, exp2 with the scale folded into log2(e).

Query row i of a chunk of q_len rows sits at position kv_len - q_len + i and sees keys
0..that position (docs/design.md#chunks), the same rule as the torch backend.

Verified on CPU only, under TRITON_INTERPRET=1 against the torch backend
(tests/test_triton_attention.py). Not yet run on a GPU: tile sizes and num_warps below are
first guesses, and a long-context decode at small batch launches only R * KVH programs (no
split-KV yet), which under-fills a large GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.attention.torch_backend import write_kv

_LOG2E = 1.4426950408889634
# Triton's interpreter (numpy underneath) gets tl.dot on bfloat16/float16 operands wrong, so
# there the 16-bit operands are widened to float32 first (after the same rounding of P to the
# cache dtype a GPU does). The GPU path keeps 16-bit tensor-core dots: its rounding is not
# what the CPU tests see.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _paged_attention_kernel(
        Q, K, V, O, cu_seqlens_q, kv_lens, block_table,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        scale_log2, head_dim, group, block_size,
        BLOCK_Q: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    req = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + req)
    q_len = tl.load(cu_seqlens_q + req + 1) - q_start
    if tile * BLOCK_Q < q_len:
        kv_len = tl.load(kv_lens + req)
        r = tl.arange(0, BLOCK_Q * GROUP_P)
        qi = tile * BLOCK_Q + r // GROUP_P             # query row within the chunk
        hg = r % GROUP_P                               # query head within the KV head's group
        row_ok = (qi < q_len) & (hg < group)
        head = kvh * group + hg
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_off = (q_start + qi).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        q = tl.load(Q + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0)
        # rows past the chunk get positions >= kv_len: they see every key and stay finite
        q_pos = kv_len - q_len + qi
        # keys this tile can see: up to its last row's position (the causal bound)
        hi = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_Q)

        m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
        table = block_table + req.to(tl.int64) * stride_bt
        for start in range(0, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            page = tl.load(table + n // block_size, mask=n_ok, other=0).to(tl.int64)
            slot = n % block_size
            k_off = page * stride_kb + slot * stride_ks + kvh * stride_kh
            k = tl.load(K + k_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                        other=0.0)                                          # [D, N]
            if IEEE:
                s = tl.dot(q.to(k.dtype), k, input_precision="ieee")
            elif UPCAST:
                s = tl.dot(q.to(tl.float32), k.to(tl.float32))
            else:
                s = tl.dot(q.to(k.dtype), k)
            s = s * scale_log2
            sees = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            s = tl.where(sees, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = page * stride_vb + slot * stride_vs + kvh * stride_vh
            v = tl.load(V + v_off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)                                          # [N, D]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            elif UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32),
                                                    v.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        o_off = (q_start + qi).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(O + o_off[:, None] + d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                    block_n: int | None = None, rows: int | None = None) -> torch.Tensor:
    """q: [T, H, d]; caches: [blocks, block_size, KVH, d] (already holding this iteration's
    K/V). `block_n` (keys per tile) and `rows` (query rows x heads per tile) override the
    defaults, for tests that want many tiles from small shapes."""
    T, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    group = H // KVH
    assert group * KVH == H, (H, KVH)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q) if out is None else out
    group_p = _pow2(group)
    # tl.dot wants every dimension >= 16: a decode tile is padded to 16 (row x head) slots
    m = rows or (16 if meta.max_seqlen_q == 1 else 64)
    block_q = max(1, _pow2(m) // group_p)
    block_n = block_n or 64
    block_d = max(16, _pow2(D))
    R = meta.cu_seqlens_q.shape[0] - 1
    grid = (triton.cdiv(meta.max_seqlen_q, block_q), R, KVH)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seqused_k, meta.block_table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_table.stride(0),
        scale * _LOG2E, D, group, block_size,
        BLOCK_Q=block_q, GROUP_P=group_p, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=k_cache.dtype == torch.float32,     # float32: no TF32 (exact against the CPU)
        UPCAST=_INTERPRETED and k_cache.dtype != torch.float32,
        num_warps=4 if block_q * group_p <= 64 else 8)
    return out


class TritonAttentionBackend:
    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)
