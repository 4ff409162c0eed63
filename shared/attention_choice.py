"""Which attention backend a worker runs, and the KV block size that goes with it
(`--attention-backend auto|flash-attn|triton|torch`, `--block-size`), decided by one pure
function so that the scheduler (which never imports torch) and the workers agree, and so the
rules are testable without a GPU. Nothing falls back silently: a backend that cannot run here
is an error naming the flag that would work, and the choice and its reason are logged once
when the worker starts (docs/gpu.md).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from shared.config import DEFAULT_BLOCK_SIZE, check_block_size
from shared.errors import PacerError

BACKENDS = ("auto", "flash-attn", "triton", "torch")
# flash-attn 2's paged KV (its block_table argument) takes pages of a multiple of 256 tokens
FLASH_BLOCK_MULTIPLE = 256


@dataclass(frozen=True)
class AttentionChoice:
    backend: str        # flash-attn, triton or torch
    block_size: int
    reason: str         # one line for the start-up log


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (nor torch)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def choose_attention(requested: str, device: str, dtype: str, block_size: int | None,
                     flash_available: bool, triton_available: bool,
                     interpreted: bool = False) -> AttentionChoice:
    """The backend and block size for `--attention-backend requested` on `device` with weights
    in `dtype` (already resolved from auto); `block_size` None means the backend's default.

    auto: on CUDA, flash-attn when it is installed and the dtype is 16-bit (and the block size,
    if given, is a multiple of 256), else our Triton kernel; on CPU, torch with the C++
    kernels. `interpreted` (TRITON_INTERPRET=1) lets the Triton backend run on CPU tensors —
    slowly; for tests and the CPU smoke run of bench/gpu_check.py."""
    if requested not in BACKENDS:
        raise PacerError(f"--attention-backend must be one of {', '.join(BACKENDS)}, "
                         f"got {requested!r}")
    if block_size is not None:
        check_block_size(block_size)
    cuda = device.startswith("cuda")
    if requested == "auto":
        if not cuda:
            return AttentionChoice("torch", block_size or DEFAULT_BLOCK_SIZE,
                                   f"auto on {device}: torch (with the C++ CPU kernels)")
        flash_ok = (flash_available and dtype in ("bfloat16", "float16")
                    and (block_size is None or block_size % FLASH_BLOCK_MULTIPLE == 0))
        if flash_ok:
            choice = choose_attention("flash-attn", device, dtype, block_size, flash_available,
                                      triton_available, interpreted)
            return AttentionChoice(choice.backend, choice.block_size,
                                   f"auto on {device}: flash-attn (installed), block size "
                                   f"{choice.block_size}")
        if not triton_available:
            raise PacerError("--attention-backend auto on CUDA needs flash-attn or triton and "
                             "neither is installed: pip install triton (or flash-attn), or "
                             "pass --attention-backend torch (gathers K/V per layer; slow)")
        why = ("flash-attn is not installed" if not flash_available else
               f"flash-attn needs bfloat16/float16, the dtype is {dtype}"
               if dtype not in ("bfloat16", "float16") else
               f"flash-attn needs a block size that is a multiple of {FLASH_BLOCK_MULTIPLE}, "
               f"--block-size is {block_size}")
        choice = choose_attention("triton", device, dtype, block_size, flash_available,
                                  triton_available, interpreted)
        return AttentionChoice(choice.backend, choice.block_size, f"auto on {device}: triton ({why})")

    if requested == "torch":
        return AttentionChoice("torch", block_size or DEFAULT_BLOCK_SIZE, "asked for torch")
    if requested == "flash-attn":
        if not cuda:
            raise PacerError(f"--attention-backend flash-attn runs on CUDA only, the device is "
                             f"{device}: pass --attention-backend torch (or auto)")
        if not flash_available:
            raise PacerError("--attention-backend flash-attn: flash-attn is not installed "
                             "(pip install flash-attn), or pass --attention-backend triton")
        if dtype not in ("bfloat16", "float16"):
            raise PacerError(f"--attention-backend flash-attn needs --dtype bfloat16 or float16, "
                             f"got {dtype}: change the dtype or pass --attention-backend triton")
        size = block_size or FLASH_BLOCK_MULTIPLE
        check_flash_block_size(size)
        return AttentionChoice("flash-attn", size, "asked for flash-attn")
    # triton
    if not triton_available:
        raise PacerError("--attention-backend triton: triton is not installed (pip install "
                         "triton), or pass --attention-backend torch")
    if not cuda and not interpreted:
        raise PacerError(f"--attention-backend triton runs on CUDA, the device is {device} "
                         "(set TRITON_INTERPRET=1 to run it, slowly, on CPU tensors)")
    return AttentionChoice("triton", block_size or DEFAULT_BLOCK_SIZE, "asked for triton")


def check_flash_block_size(block_size: int) -> None:
    if block_size % FLASH_BLOCK_MULTIPLE:
        raise PacerError(
            f"the flash-attn backend needs --block-size a multiple of {FLASH_BLOCK_MULTIPLE} "
            f"(its paged KV cache takes pages of that size), got {block_size}: pass "
            f"--block-size {FLASH_BLOCK_MULTIPLE}, or --attention-backend triton, which takes "
            f"any block size")


def choose_attention_here(requested: str, device: str, dtype: str,
                          block_size: int | None) -> AttentionChoice:
    """choose_attention with what is installed on this machine."""
    return choose_attention(requested, device, dtype, block_size, installed("flash_attn"),
                            installed("triton"), triton_interpreted())
