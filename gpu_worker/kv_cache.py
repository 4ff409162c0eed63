"""The paged KV block pool: one contiguous tensor [L, 2, num_blocks, block_size, KVH, hd] per
rank, handed to the model as per-layer (K, V) views of [num_blocks, block_size, KVH, hd].

Only this rank's KV heads live here. Which request owns which block is decided by the
scheduler's BlockManager; the worker only writes through slot mappings and reads through
block tables. One allocation means one memory registration covers the whole pool for the KV
connector (gpu_worker/kv_transfer), and block (l, kv, b) starts at byte
((l·2 + kv)·num_blocks + b)·block_bytes of it (`block_offset`).
"""
from __future__ import annotations

import math

import torch

from gpu_worker.host_memory import huge_page_buffer
from shared.kv_layout import DIGEST_STRIDE_BYTES
from shared.model_config import ModelConfig


def allocate_kv_pool(cfg: ModelConfig, num_blocks: int, block_size: int, num_kv_heads: int,
                     dtype: torch.dtype, device: str) -> torch.Tensor:
    """The whole pool, zeroed: [L, 2 (K, V), num_blocks, block_size, KVH, hd]. On CPU in huge
    pages (gpu_worker/host_memory.py), written once here so that no page faults in mid-step."""
    shape = (cfg.num_layers, 2, num_blocks, block_size, num_kv_heads, cfg.head_dim)
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return huge_page_buffer(nbytes).view(dtype).view(shape).zero_()


def layer_views(pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (K, V) views of the pool the model and the attention backends use."""
    return [(pool[layer, 0], pool[layer, 1]) for layer in range(pool.shape[0])]


def block_bytes(pool: torch.Tensor) -> int:
    """Bytes of one block of K (or V) of one layer."""
    return pool[0, 0, 0].numel() * pool.element_size()


def block_offset(layer: int, kv: int, block: int, num_blocks: int, nbytes: int) -> int:
    """Byte offset of block `block` of layer `layer`'s K (kv=0) or V (kv=1) in the pool."""
    return ((layer * 2 + kv) * num_blocks + block) * nbytes


def block_digests(pool: torch.Tensor, block_ids: list[int]) -> list[int]:
    """Per block, a digest of its K/V in every layer: the sum of a word sampled every
    DIGEST_STRIDE_BYTES and of the last word, each layer's K and V weighted by an odd number
    of their own (docs/design.md#kv-integrity). Both sides of a KV transfer take it of the
    same blocks: a write that did not land, or landed in part, elsewhere, or in another
    layer's or the other of K/V's place, changes it; ~0.6 ms for a 1.5k-token prompt of the
    default model."""
    words = pool.view(pool.shape[0], 2, pool.shape[2], -1).view(torch.uint8)
    if words.shape[-1] % 4 == 0:
        words = words.view(torch.int32)
    step = max(1, DIGEST_STRIDE_BYTES // words.element_size())
    ids = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    # slice before indexing: only the sampled words are gathered; [layer, K/V, block]
    per_part = (words[..., ::step][:, :, ids].sum(dim=3, dtype=torch.int64)
                + words[..., -1][:, :, ids].to(torch.int64))
    weights = 2 * torch.arange(per_part.shape[0] * 2, device=pool.device) + 1
    return (per_part * weights.view(-1, 2, 1)).sum(dim=(0, 1)).tolist()


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, num_kv_heads: int,
                      dtype: torch.dtype, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) of [num_blocks, block_size, KVH, hd], views of one contiguous pool."""
    return layer_views(allocate_kv_pool(cfg, num_blocks, block_size, num_kv_heads, dtype, device))
