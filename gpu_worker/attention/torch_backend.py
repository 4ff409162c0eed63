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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        # q: [T, H, d]; k, v: [T, KVH, d]; caches: [blocks, block_size, KVH, d]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        for g in meta.groups:
            qg = q[g.q_index].transpose(1, 2)                       # [G, H, q, d]
            if g.fresh:                                             # keys = the chunk itself
                kg, vg = k[g.q_index], v[g.q_index]                 # [G, q, KVH, d]
                mask, causal = None, True
            else:
                kg = k_cache[g.block_tables].flatten(1, 2)[:, :g.kv_len_max]
                vg = v_cache[g.block_tables].flatten(1, 2)[:, :g.kv_len_max]
                mask, causal = g.mask, False
            o = F.scaled_dot_product_attention(
                qg, kg.transpose(1, 2), vg.transpose(1, 2), attn_mask=mask, is_causal=causal,
                scale=scale, enable_gqa=True)
            out[g.q_index] = o.transpose(1, 2)
        return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this iteration's K/V rows in their slots (block * block_size + offset)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
