"""Varlen paged attention in plain torch, for CPU (and any device without flash-attn).

Chunks with the same number of Q rows are attended together: their cached keys are gathered
from the block pool through the block tables into one padded [G, L] batch, and a mask built
once per iteration hides padding and future keys. All decodes of an iteration are one group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, kernels=None) -> None:
        # on CPU, the C++ kernels of cpu_kernels.py (decode, and prefill chunks when the build
        # supports the head size), reading K/V in place; None: torch ops for every chunk
        self._kernels = kernels
        self._prefill_supported: dict[tuple[int, int], bool] = {}   # (head_dim, group) -> bool
        # Gathered K/V are reused layer after layer: allocating tens of MB per layer costs
        # page faults (the CPU allocator returns big blocks to the OS) — more than the copy.
        self._workspace: dict[str, torch.Tensor] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        # q: [T, H, d]; k, v: [T, KVH, d]; caches: [blocks, block_size, KVH, d]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        kernels = self._kernels if q.dtype == torch.float32 and \
            k_cache.dtype in (torch.float32, torch.bfloat16) else None
        prefill_in_kernel = kernels is not None and self._prefill_in_kernel(q.shape[-1],
                                                                            q.shape[1] // k.shape[1])
        out = torch.empty_like(q)
        if prefill_in_kernel and meta.max_seqlen_q > 1:     # every chunk of 2+ rows, in place
            kernels.paged_prefill_attention(q.contiguous(), k_cache, v_cache, meta.block_table,
                                            meta.cu_seqlens_q, meta.seqused_k, 2, scale, out)
        for g in meta.groups:
            G, rows = g.q_index.shape
            if rows > 1 and prefill_in_kernel:
                continue
            if rows == 1 and not g.fresh and g.prompt_rows and prefill_in_kernel:
                o = self._prefill_rows(_rows(q, g), k_cache, v_cache, g, scale)
            elif rows == 1 and not g.fresh and kernels is not None:
                o = self._decode(_rows(q, g), k_cache, v_cache, g, scale)
            else:
                o = self._attend(q, k, v, k_cache, v_cache, g, scale)
            if g.all_rows:
                return o
            out.index_copy_(0, g.q_index.flatten(), o)
        return out

    def decode_block(self, qkv: torch.Tensor, rotary, kv_cache, meta: AttentionMetadata,
                     scale: float, q_size: int) -> torch.Tensor | None:
        """An iteration of decodes alone, from the fused projection's bfloat16 output qkv
        [T, (H + 2·KVH)·d]: RoPE, the K/V store and attention in one C++ op (csrc/
        paged_decode.cpp), the output [T, H·d] in bfloat16 for o_proj. None when the
        iteration holds a prefill chunk, or the kernels cannot run it: then the caller takes
        the op-by-op path."""
        k_cache, v_cache = kv_cache
        g = self.decode_group(meta, k_cache.dtype)
        if g is None or qkv.dtype != torch.bfloat16:
            return None
        out = qkv.new_empty((qkv.shape[0], q_size))
        self._kernels.decode_attention_block(qkv, meta.positions, rotary.cos, rotary.sin,
                                             k_cache, v_cache, meta.slot_mapping, g.block_tables,
                                             g.kv_lens, scale, out)
        return out

    def decode_group(self, meta: AttentionMetadata, cache_dtype: torch.dtype):
        """The iteration's one group when it holds decodes alone (one row per request over
        its cache, no prompt row) that the kernels' decode_attention_block runs; else None."""
        kernels = self._kernels
        if kernels is None or not hasattr(kernels, "decode_attention_block") or \
                len(meta.groups) != 1 or cache_dtype not in (torch.float32, torch.bfloat16):
            return None
        g = meta.groups[0]
        if g.q_index.shape[1] != 1 or g.fresh or not g.all_rows or g.prompt_rows:
            return None
        return g

    def mixed_rows(self, meta: AttentionMetadata, cache_dtype: torch.dtype, head_dim: int,
                   group: int) -> torch.Tensor | None:
        """For an iteration with prompt chunks, which rows `forward` would attend by the
        prefill kernel (1) and which by the decode kernel (0), [T] uint8: the kernels'
        DecoderStack.mixed then runs every layer in one call with the same bits. None where
        `forward` would use anything else (torch's attention for a chunk, no prefill kernel for
        this head size). Asked only of an iteration that is not decodes alone (`decode_group`
        said None)."""
        kernels = self._kernels
        if kernels is None or cache_dtype not in (torch.float32, torch.bfloat16) or \
                not self._prefill_in_kernel(head_dim, group):
            return None
        by_prefill = torch.ones(meta.positions.shape[0], dtype=torch.uint8)
        for g in meta.groups:
            if g.q_index.shape[1] == 1 and not g.prompt_rows:
                if g.fresh:             # a one-token prompt: torch's attention in `forward`
                    return None
                by_prefill[g.q_index.flatten()] = 0
        return by_prefill

    def _prefill_in_kernel(self, head_dim: int, group: int) -> bool:
        key = (head_dim, group)
        if key not in self._prefill_supported:          # once per shape, not once per layer
            self._prefill_supported[key] = self._kernels.paged_prefill_supported(head_dim, group)
        return self._prefill_supported[key]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g,
                scale: float) -> torch.Tensor:
        """One query row per request, K/V read in place through the block tables."""
        q = q.contiguous()                                            # [G, H, d] float32
        o = torch.empty_like(q)
        self._kernels.paged_decode_attention(q, k_cache, v_cache, g.block_tables, g.kv_lens, scale, o)
        return o

    def _prefill_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g,
                      scale: float) -> torch.Tensor:
        """Single rows at prompt positions by the prefill kernel, which computes every other
        row of their prompts (the decode kernel's sums run in another order): a prompt's
        bits do not depend on where the budget cut its chunks."""
        q = q.contiguous()                                            # [G, H, d] float32
        o = torch.empty_like(q)
        G = q.shape[0]
        self._kernels.paged_prefill_attention(
            q, k_cache, v_cache, g.block_tables.to(torch.int32),
            torch.arange(G + 1, dtype=torch.int32), g.kv_lens.to(torch.int32), 1, scale, o)
        return o

    def _attend(self, q, k, v, k_cache, v_cache, g, scale: float) -> torch.Tensor:
        """Any chunks of equal q_rows as one padded batch: SDPA with the group's mask."""
        G, rows = g.q_index.shape
        qg = _rows(q, g).view(G, rows, *q.shape[1:]).transpose(1, 2)     # [G, H, q, d]
        if g.fresh:                                             # keys = the chunk itself
            kg = _as_cached(_rows(k, g), k_cache).view(G, rows, *k.shape[1:])  # [G, q, KVH, d]
            vg = _as_cached(_rows(v, g), v_cache).view(G, rows, *v.shape[1:])
            mask, causal = None, True
        else:
            kg = self._gather_blocks(k_cache, g, "k").to(q.dtype)
            vg = self._gather_blocks(v_cache, g, "v").to(q.dtype)
            mask, causal = g.mask, False
        o = F.scaled_dot_product_attention(
            qg, kg.transpose(1, 2), vg.transpose(1, 2), attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(G * rows, *q.shape[1:])

    def _gather_blocks(self, cache: torch.Tensor, g, name: str) -> torch.Tensor:
        """[G, kv_len_max, KVH, d] from the block pool; index_select copies whole blocks, an
        order of magnitude faster on CPU than advanced indexing with the 2-D table."""
        G, blocks = g.block_tables.shape
        shape = (G * blocks, *cache.shape[1:])
        n = shape[0] * cache[0].numel()
        buf = self._workspace.get(name)
        if buf is None or buf.numel() < n or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = self._workspace[name] = torch.empty(n, dtype=cache.dtype, device=cache.device)
        flat = torch.index_select(cache, 0, g.block_tables.flatten(), out=buf[:n].view(shape))
        return flat.view(G, blocks * cache.shape[1], *cache.shape[2:])[:, :g.kv_len_max]


def _rows(x: torch.Tensor, g) -> torch.Tensor:
    """The group's rows of the flat batch (no copy when the group is the whole batch)."""
    return x if g.all_rows else x.index_select(0, g.q_index.flatten())


def _as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x rounded to the cache's precision (and back): a fresh prefill then attends to exactly
    the keys a later chunk or decode will read from the cache, so a narrower cache gives the
    same tokens however a prompt is chunked."""
    return x if x.dtype == cache.dtype else x.to(cache.dtype).to(x.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this iteration's K/V rows in their slots (block * block_size + offset)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
