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

Tested on CPU under TRITON_INTERPRET=1 against the torch backend
(tests/test_triton_attention.py), and timed on an H200 by bench/gpu_check.sh (docs/gpu.md).
An iteration of few decodes splits each request's keys across programs (split-KV, below).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.attention.torch_backend import write_kv
from gpu_worker.model.triton_ops import rope_store_

_LOG2E = 1.4426950408889634
# Triton's interpreter (numpy underneath) gets tl.dot on bfloat16/float16 operands wrong, so
# there the 16-bit operands are widened to float32 first (after the same rounding of P to the
# cache dtype a GPU does). The GPU path keeps 16-bit tensor-core dots: its rounding is not
# what the CPU tests see.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _paged_attention_kernel(
        Q, K, V, O, cu_seqlens_q, kv_lens, block_table, part_m, part_l, part_acc, counters,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        scale_log2, head_dim, group, block_size, num_rows, num_heads, split_len, num_splits,
        BLOCK_Q: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
        FUSED_COMBINE: tl.constexpr):
    tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
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
        # keys this tile can see: up to its last row's position (the causal bound); with
        # SPLIT, only this program's slice of them
        hi = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_Q)
        lo = 0
        if SPLIT:
            lo = split * split_len
            hi = tl.minimum(hi, lo + split_len)

        m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
        table = block_table + req.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
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
        if SPLIT:
            # unnormalised partials of this key slice; the last slice of (request, KV head) to
            # finish merges them (a slice past kv_len writes nothing and is not counted)
            if lo < hi:
                p_off = (split * num_rows + q_start + qi).to(tl.int64) * num_heads + head
                tl.store(part_m + p_off, m_i, mask=row_ok)
                tl.store(part_l + p_off, l_i, mask=row_ok)
                tl.store(part_acc + p_off[:, None] * BLOCK_D + d[None, :], acc,
                         mask=row_ok[:, None])
                if FUSED_COMBINE:
                    tl.debug_barrier()          # every thread's partials before the count
                    counter = counters + req * tl.num_programs(2) + kvh
                    used = tl.cdiv(kv_len, split_len)
                    if tl.atomic_add(counter, 1, sem="acq_rel") == used - 1:
                        tl.store(counter, 0)    # zero again for the next layer
                        _combine_group(O, part_m, part_l, part_acc, q_start, kvh * group,
                                       group, used, stride_ot, stride_oh, head_dim, num_rows,
                                       num_heads, GROUP_P, BLOCK_D)
        else:
            out = acc / l_i[:, None]
            o_off = (q_start + qi).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
            tl.store(O + o_off[:, None] + d[None, :], out.to(O.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_group(O, part_m, part_l, part_acc, row, head0, group, used, stride_ot, stride_oh,
                   head_dim, num_rows, num_heads, GROUP_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """Decode row `row`, query heads head0 .. head0 + group: flash-decoding's log-sum-exp merge
    of the `used` key slices' partials, read a few slices at a time (past L1: other programs
    wrote them)."""
    CHUNK: tl.constexpr = 8
    g = tl.arange(0, GROUP_P)
    g_ok = g < group
    head = head0 + g
    s = tl.arange(0, CHUNK)
    d = tl.arange(0, BLOCK_D)
    mx = tl.full([GROUP_P], float("-inf"), tl.float32)
    for c in range(0, used, CHUNK):
        off = ((c + s[:, None]) * num_rows + row).to(tl.int64) * num_heads + head[None, :]
        ok = ((c + s[:, None]) < used) & g_ok[None, :]
        mx = tl.maximum(mx, tl.max(tl.load(part_m + off, mask=ok, other=float("-inf"),
                                           cache_modifier=".cg"), 0))
    mx = tl.where(g_ok, mx, 0.0)                        # padding heads: nothing to merge
    denom = tl.zeros([GROUP_P], tl.float32)
    out = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    for c in range(0, used, CHUNK):
        off = ((c + s[:, None]) * num_rows + row).to(tl.int64) * num_heads + head[None, :]
        ok = ((c + s[:, None]) < used) & g_ok[None, :]
        m = tl.load(part_m + off, mask=ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(ok, tl.exp2(m - mx[None, :]), 0.0)                     # [CHUNK, G]
        denom += tl.sum(tl.load(part_l + off, mask=ok, other=0.0, cache_modifier=".cg") * w, 0)
        acc = tl.load(part_acc + off[:, :, None] * BLOCK_D + d[None, None, :],
                      mask=ok[:, :, None], other=0.0, cache_modifier=".cg")  # [CHUNK, G, D]
        out += tl.sum(acc * w[:, :, None], 0)
    out = out / tl.where(g_ok, denom, 1.0)[:, None]
    o_off = row.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(O + o_off[:, None] + d[None, :], out.to(O.dtype.element_ty),
             mask=g_ok[:, None] & (d[None, :] < head_dim))


@triton.jit
def _combine_splits_kernel(O, part_m, part_l, part_acc, kv_lens, stride_ot, stride_oh,
                           head_dim, num_rows, num_heads, split_len,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Decodes only (row r is request r): one program per (row, head) merges the key slices
    in use, flash-decoding's log-sum-exp combine."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(kv_lens + row), split_len)
    s = tl.arange(0, BLOCK_S)
    ok = s < used
    off = (s * num_rows + row).to(tl.int64) * num_heads + head
    m = tl.load(part_m + off, mask=ok, other=float("-inf"))
    w = tl.exp2(m - tl.max(m, 0))
    w = tl.where(ok, w, 0.0)
    denom = tl.sum(tl.load(part_l + off, mask=ok, other=0.0) * w, 0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc + off[:, None] * BLOCK_D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(O + row.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh + d,
             out.to(O.dtype.element_ty), mask=d < head_dim)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Split-KV for decodes (flash-decoding): an iteration of decodes alone launches one program
# per (request, KV head) — 8 programs for one Llama-3-8B stream, on a GPU of 132 SMs. Below
# SPLIT_BELOW_PROGRAMS such programs, each request's keys are cut into slices of split_len
# (a multiple of the key tile) attended by programs of their own, then merged. The slice
# length comes from max_seqlen_k — under CUDA graphs the longest context the graph allows, so
# a short context uses few slices — keeping at most MAX_SPLITS slices.
SPLIT_BELOW_PROGRAMS = 128
MAX_SPLITS = 128
# FUSED_COMBINE: the merge runs in the attention kernel itself, in the last program of each
# (request, KV head) to finish, found through an atomic count per pair (zeroed again by that
# program): one launch a layer fewer than _combine_splits_kernel. Off until a GPU has run it:
# it is right under the interpreter and compiles for sm_80/sm_90 (tests), but the ordering of
# its atomic and loads, and its speed, are unproven on hardware. bench/gpu_check.py checks it
# against the torch backend there and times it (docs/gpu.md#one-row-decode).
FUSED_COMBINE = False
_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counts, at least n, kept per device (each kernel leaves them zero).
    Allocated by the first, eager forward of a size, before a CUDA graph captures it."""
    have = _counters.get(device)
    if have is None or have.numel() < n:
        have = _counters[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return have


def _splits(meta: AttentionMetadata, programs: int, block_n: int,
            split_len: int | None) -> tuple[int, int]:
    """(num_splits, split_len); (1, 0) when the iteration is not split."""
    if split_len is None:
        if meta.max_seqlen_q != 1 or programs >= SPLIT_BELOW_PROGRAMS or _INTERPRETED:
            return 1, 0
        split_len = block_n * max(1, triton.cdiv(triton.cdiv(meta.max_seqlen_k, block_n),
                                                 MAX_SPLITS))
    assert meta.max_seqlen_q == 1 and split_len % block_n == 0, (meta.max_seqlen_q, split_len)
    return triton.cdiv(meta.max_seqlen_k, split_len), split_len


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                    block_n: int | None = None, rows: int | None = None,
                    split_len: int | None = None) -> torch.Tensor:
    """q: [T, H, d]; caches: [blocks, block_size, KVH, d] (already holding this iteration's
    K/V). `block_n` (keys per tile), `rows` (query rows x heads per tile) and `split_len`
    (keys per split-KV slice; decodes only) override the defaults, for tests that want many
    tiles or slices from small shapes."""
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
    num_splits, split_len = _splits(meta, R * KVH, block_n, split_len)
    split = num_splits > 1
    if split:
        part_m = torch.empty((num_splits, T, H), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_splits, T, H, block_d), dtype=torch.float32, device=q.device)
        counters = _split_counters(q.device, R * KVH) if FUSED_COMBINE else part_m
    else:
        part_m = part_l = part_acc = counters = out      # not read
    grid = (triton.cdiv(meta.max_seqlen_q, block_q) * num_splits, R, KVH)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seqused_k, meta.block_table,
        part_m, part_l, part_acc, counters,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_table.stride(0),
        scale * _LOG2E, D, group, block_size, T, H, split_len, num_splits,
        BLOCK_Q=block_q, GROUP_P=group_p, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=k_cache.dtype == torch.float32,     # float32: no TF32 (exact against the CPU)
        UPCAST=_INTERPRETED and k_cache.dtype != torch.float32, SPLIT=split,
        FUSED_COMBINE=FUSED_COMBINE, num_warps=4 if block_q * group_p <= 64 else 8)
    if split and not FUSED_COMBINE:
        _combine_splits_kernel[(R, H)](
            out, part_m, part_l, part_acc, meta.seqused_k, out.stride(0), out.stride(1),
            D, T, H, split_len, BLOCK_S=max(2, _pow2(num_splits)), BLOCK_D=block_d)
    return out


class TritonAttentionBackend:
    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)

    def rope_store_attend(self, qkv: torch.Tensor, rotary, kv_cache, meta: AttentionMetadata,
                          scale: float, n_heads: int, n_kv: int) -> torch.Tensor:
        """From the QKV GEMM's 16-bit output [T, (H + 2·KVH)·hd]: RoPE and the K/V store as
        one launch (gpu_worker/model/triton_ops.py rope_store_), then attention; [T, H, hd]."""
        k_cache, v_cache = kv_cache
        q = rope_store_(qkv, meta.positions, meta.slot_mapping, rotary.cos, rotary.sin, k_cache,
                        v_cache, n_heads, n_kv, k_cache.shape[-1])
        return paged_attention(q, k_cache, v_cache, meta, scale)
