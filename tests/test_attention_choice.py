"""--attention-backend and --block-size: the pure decision (shared/attention_choice.py) for
every device/installation without needing either, and the flash-attn backend's refusal of a
block size it cannot take. Never a silent fallback: every refusal names the flag that works."""
from __future__ import annotations

import pytest

from shared.attention_choice import choose_attention
from shared.engine_args import EngineArgs
from shared.errors import PacerError


def choose(requested, device="cuda", dtype="bfloat16", block_size=None, flash=True,
           triton=True, interpreted=False):
    return choose_attention(requested, device, dtype, block_size, flash, triton, interpreted)


def test_auto_on_cuda_prefers_flash_attn_with_its_block_size():
    c = choose("auto")
    assert (c.backend, c.block_size) == ("flash-attn", 256)
    assert "flash-attn" in c.reason
    assert choose("auto", block_size=512).block_size == 512


@pytest.mark.parametrize("kw,why", [
    (dict(flash=False), "not installed"),
    (dict(dtype="float32"), "float32"),
    (dict(block_size=16), "multiple of 256"),
])
def test_auto_on_cuda_takes_triton_and_says_why(kw, why):
    c = choose("auto", **kw)
    assert c.backend == "triton" and why in c.reason
    assert c.block_size == kw.get("block_size", 16)


def test_auto_on_cuda_with_neither_installed_is_an_error():
    with pytest.raises(PacerError, match="--attention-backend torch"):
        choose("auto", flash=False, triton=False)


def test_auto_on_cpu_is_torch_whatever_is_installed():
    c = choose("auto", device="cpu", dtype="float32")
    assert (c.backend, c.block_size) == ("torch", 16)
    assert choose("auto", device="cpu", block_size=32).block_size == 32


def test_flash_attn_refuses_what_it_cannot_take():
    with pytest.raises(PacerError, match="--block-size 256"):
        choose("flash-attn", block_size=16)
    with pytest.raises(PacerError, match="not installed"):
        choose("flash-attn", flash=False)
    with pytest.raises(PacerError, match="bfloat16 or float16"):
        choose("flash-attn", dtype="float32")
    with pytest.raises(PacerError, match="CUDA only"):
        choose("flash-attn", device="cpu")
    assert choose("flash-attn", block_size=512).block_size == 512


def test_triton_needs_cuda_or_the_interpreter_and_takes_any_block_size():
    assert choose("triton", block_size=16).block_size == 16
    assert choose("triton", block_size=7).block_size == 7
    with pytest.raises(PacerError, match="TRITON_INTERPRET"):
        choose("triton", device="cpu")
    assert choose("triton", device="cpu", interpreted=True).backend == "triton"
    with pytest.raises(PacerError, match="pip install triton"):
        choose("triton", triton=False)


def test_unknown_backend_and_bad_block_size():
    with pytest.raises(PacerError, match="must be one of"):
        choose("xformers")
    for bad in (0, 2**16 + 1):
        with pytest.raises(PacerError, match="--block-size must be from 1 to 65,536 tokens"):
            choose("torch", block_size=bad)


def test_the_flash_backend_itself_refuses_a_block_size_before_importing_flash_attn():
    from gpu_worker.attention.flash_backend import FlashAttentionBackend
    with pytest.raises(PacerError, match="multiple of 256.*--attention-backend triton"):
        FlashAttentionBackend(16)


def test_engine_args_resolve_backend_block_size_and_kv_memory_on_cpu():
    args = EngineArgs(dtype="float32").resolved()
    assert (args.attention_backend, args.block_size, args.kv_cache_memory) == ("torch", 16, "2GiB")
    assert args.resolved() == args                        # idempotent
    with pytest.raises(PacerError, match="CUDA only"):
        EngineArgs(dtype="float32", attention_backend="flash-attn").resolved()
    with pytest.raises(PacerError, match="gpu-memory-utilization"):
        EngineArgs(dtype="float32", gpu_memory_utilization=1.5).resolved()


def test_gpu_memory_sizing_arithmetic():
    from shared import gpu_memory
    from shared.model_config import ModelConfig
    llama3_8b = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 5e5, 1e-5, 8192,
                            False, 1, 2)
    w = gpu_memory.weight_bytes(llama3_8b, 2)
    assert 15.5e9 < w < 16.5e9                            # ~8.0B parameters in bf16
    act = gpu_memory.activation_bytes(llama3_8b, 512, 128, 2)
    pool = gpu_memory.kv_pool_bytes(141 * 2**30, 0.9, w, act)
    assert 100 * 2**30 < pool < 112 * 2**30
    # served, the error says which flags make room
    with pytest.raises(PacerError, match="no room for a KV cache .*: raise "
                       "--gpu-memory-utilization, lower --max-num-batched-tokens, add --tp"):
        gpu_memory.kv_pool_bytes(16 * 2**30, 0.9, w, act)


def test_select_backend_never_falls_back_to_torch():
    import importlib.util
    from gpu_worker.attention import select_backend
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(PacerError, match="cannot import flash_attn"):
        select_backend("flash-attn", "cuda", 256)
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        select_backend("auto", "cpu", 16)
    assert select_backend("torch", "cpu", 16).name == "torch"
