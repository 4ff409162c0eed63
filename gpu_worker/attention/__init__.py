"""Varlen attention over the flat batch with a paged KV cache (docs/design.md#chunks,
docs/design.md#the-paged-kv-cache).

Each request in an iteration is a chunk `(q_start, q_end, kv_len)` plus its block table. A
decode is a chunk of one row; a fresh prefill a chunk with an empty prefix; a later chunk sees
its cached prefix fully and itself causally. One code path serves all three.
"""
from gpu_worker.attention.metadata import AttentionMetadata, Chunk, build_attention_metadata

__all__ = ["AttentionMetadata", "Chunk", "build_attention_metadata", "select_backend"]


def select_backend(device: str):
    """flash-attn's varlen kernel with a block table on CUDA when installed, else torch."""
    # imported on demand: flash-attn is an optional dependency (CUDA only), and the CPU
    # kernels are compiled on first import
    if device.startswith("cuda"):
        try:
            from gpu_worker.attention.flash_backend import FlashAttentionBackend
            return FlashAttentionBackend()
        except ImportError:
            pass
    from gpu_worker.attention.torch_backend import TorchAttentionBackend
    if device == "cpu":
        from gpu_worker.cpu_kernels import cpu_kernels
        return TorchAttentionBackend(cpu_kernels())
    return TorchAttentionBackend()
