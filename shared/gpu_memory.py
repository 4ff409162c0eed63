"""`--gpu-memory-utilization`: the KV pool on CUDA gets what is left of `utilization x total`
after this rank's weights, a forward's activations and the CUDA context.

The block count must be known before any weights load, by the scheduler (which never imports
torch) and by every worker alike, so it is computed here from the GPU's total memory and the
model's shape — deterministic, the same on both sides. The worker then measures the real
figures after loading and one forward of the full token budget (gpu_worker/model_runner.py
`profile_memory`), logs them beside this estimate, and fails with the block count that would
fit when the estimate was too generous (docs/gpu.md#kv-pool-size).
"""
from __future__ import annotations

import subprocess

from shared.errors import PacerError

# CUDA context, cuBLAS workspaces, allocator slack — and nvidia-smi's total, which is above
# what CUDA hands out (H200: 143771 MiB by nvidia-smi, 143156 MiB by cudaMemGetInfo, with
# ~0.8 GB taken outside torch by the context)
CUDA_CONTEXT_BYTES = 2 << 30


def weight_bytes(cfg, dtype_bytes: float, tp: int = 1) -> int:
    """This rank's share of a llama-style model's weights (`ModelShape.params_per_rank`)."""
    from shared.cost_model import model_shape_of

    return int(model_shape_of(cfg, "").params_per_rank(tp) * dtype_bytes)


def activation_bytes(cfg, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int,
                     tp: int = 1) -> int:
    """A generous bound on one forward's live activations: a few hidden-sized buffers and the
    gated MLP's two intermediate ones per token, and float32 logits (and their softmax) for
    every sampling row."""
    t = max_num_batched_tokens
    per_token = (6 * cfg.hidden_size + 3 * cfg.intermediate_size // tp
                 + 3 * cfg.num_heads * cfg.head_dim // tp) * dtype_bytes
    return t * per_token + 3 * max_num_seqs * cfg.vocab_size * 4


# What to change when the pool gets nothing, in the flags of `pacer up`, `pacer generate`
# and `pacer simulate` (`pacer cost` has none of them and says its own)
SERVING_REMEDY = ("raise --gpu-memory-utilization, lower --max-num-batched-tokens, add --tp, "
                  "or give --kv-cache-memory/--num-kv-blocks")


def kv_pool_bytes(total: int, utilization: float, weights: int, activations: int,
                  remedy: str = SERVING_REMEDY) -> int:
    """What is left for the KV pool; PacerError ending in `remedy` (what to change, in the
    flags of the command that asked) when nothing is."""
    pool = int(total * utilization) - weights - activations - CUDA_CONTEXT_BYTES
    if pool <= 0:
        gib = 1 << 30
        raise PacerError(
            f"{utilization:g} of {total / gib:.1f} GiB leaves no room for a KV cache after "
            f"{weights / gib:.1f} GiB of weights, "
            f"~{activations / gib:.1f} GiB of activations and "
            f"{CUDA_CONTEXT_BYTES / gib:.0f} GiB for CUDA: {remedy}")
    return pool


def check_cuda_device(device: str, ranks: int = 1) -> None:
    """PacerError in one line when `device` (cuda or cuda:N, one GPU a rank from N on) is not
    there for this torch: a CPU build, no GPU visible, or too few of them."""
    import torch
    if not torch.backends.cuda.is_built():
        raise PacerError(f"--device {device}: this torch ({torch.__version__}) is built without "
                         f"CUDA; install a CUDA build of torch or serve with --device cpu")
    count = torch.cuda.device_count()
    first = int(device.partition(":")[2] or 0)
    if first + ranks > count:
        raise PacerError(f"--device {device} with {ranks} rank(s) needs GPUs {first}.."
                         f"{first + ranks - 1}, and {count} GPU(s) are visible")


def cuda_total_memory(device: str) -> int:
    """Total bytes of the GPU `device` names (cuda or cuda:N), asked of nvidia-smi so that the
    scheduler need not import torch nor open a CUDA context; torch when there is no
    nvidia-smi."""
    index = device.partition(":")[2] or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                              "nounits", "-i", index], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return int(out.strip().splitlines()[0]) * (1 << 20)       # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    # no nvidia-smi: a torch without CUDA, or without this GPU, is named as such (giving the
    # pool's size would not help then)
    check_cuda_device(device)
    try:
        import torch
        return torch.cuda.get_device_properties(int(index)).total_memory
    except Exception as e:        # CUDA there, its memory not readable: say what to pass
        raise PacerError(f"cannot read the memory of {device} ({e}): give --kv-cache-memory "
                         f"or --num-kv-blocks") from e
