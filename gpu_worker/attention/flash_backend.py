"""flash-attn's varlen kernel reading K/V straight from the paged pool through block tables.

`causal=True` in flash-attn >= 2.1 aligns the mask to the bottom-right corner, which is
exactly a chunk over a cached prefix: query i sees keys up to kv_len - q_rows + i. Upstream
flash-attn 2 needs the page (block) size to be a multiple of 256, and fp16/bf16 tensors;
shared/attention_choice.py picks 256 for this backend and refuses what it cannot take.
Not run on a GPU in this repository's tests (flash-attn is not installed on the CPU machines).
"""
from __future__ import annotations

import torch

from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.attention.torch_backend import write_kv
from shared.attention_choice import check_flash_block_size
from shared.errors import PacerError


class FlashAttentionBackend:
    name = "flash-attn"

    def __init__(self, block_size: int):
        check_flash_block_size(block_size)          # before the import: testable anywhere
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as e:
            raise PacerError(f"--attention-backend flash-attn: cannot import flash_attn ({e}); "
                             "install it or pass --attention-backend triton") from e
        self._varlen = flash_attn_varlen_func

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        cu_k = torch.zeros_like(meta.cu_seqlens_q)
        torch.cumsum(meta.seqused_k, 0, out=cu_k[1:])
        return self._varlen(
            q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=meta.block_table)
