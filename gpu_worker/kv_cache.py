"""The paged KV block pool: per layer, K and V tensors of [num_blocks, block_size, KVH, hd].

Only this rank's KV heads live here. Which request owns which block is decided by the
scheduler's BlockManager; the worker only writes through slot mappings and reads through
block tables.
"""
from __future__ import annotations

import torch

from shared.model_config import ModelConfig


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, num_kv_heads: int,
                      dtype: torch.dtype, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
