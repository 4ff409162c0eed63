"""flash-attn's varlen kernel reading K/V straight from the paged pool through block tables.

`causal=True` in flash-attn >= 2.1 aligns the mask to the bottom-right corner, which is
exactly a chunk over a cached prefix: query i sees keys up to kv_len - q_rows + i. Upstream
flash-attn 2 needs the page (block) size to be a multiple of 256.
"""
from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func  # ImportError here selects the torch backend

from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.attention.torch_backend import write_kv


class FlashAttentionBackend:
    name = "flash-attn"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        cu_k = torch.zeros_like(meta.cu_seqlens_q)
        torch.cumsum(meta.seqused_k, 0, out=cu_k[1:])
        return flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=meta.block_table)
