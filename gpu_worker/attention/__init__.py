"""Varlen attention over the flat batch with a paged KV cache (docs/design.md#chunks,
docs/design.md#the-paged-kv-cache).

Each request in an iteration is a chunk `(q_start, q_end, kv_len)` plus its block table. A
decode is a chunk of one row; a fresh prefill a chunk with an empty prefix; a later chunk sees
its cached prefix fully and itself causally. One code path serves all three.
"""
from gpu_worker.attention.metadata import AttentionMetadata, Chunk, build_attention_metadata

__all__ = ["AttentionMetadata", "Chunk", "build_attention_metadata", "select_backend"]


def select_backend(name: str, device: str, block_size: int):
    """The backend `name` (already decided by shared/attention_choice.py: flash-attn, triton or
    torch). No fallback: an import that fails here is an error, not a quiet switch to torch."""
    if name == "flash-attn":
        from gpu_worker.attention.flash_backend import FlashAttentionBackend
        return FlashAttentionBackend(block_size)
    if name == "triton":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if name != "torch":
        raise ValueError(f"unknown attention backend {name!r} (resolve 'auto' first)")
    from gpu_worker.attention.torch_backend import TorchAttentionBackend
    if device == "cpu":
        from gpu_worker.cpu_kernels import cpu_kernels
        return TorchAttentionBackend(cpu_kernels())
    return TorchAttentionBackend()
