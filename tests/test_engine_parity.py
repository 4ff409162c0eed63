"""Greedy output identical, token for token, to Hugging Face transformers (float32), whatever
the batching: a budget larger than every prompt, a budget of 16 (chunks + piggybacking), and a
KV pool so small that preemption happens."""
from __future__ import annotations

import os

import pytest
import torch

from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.sampling import SamplingParams
from tests.helpers_tiny_model import write_tiny_llama
from tests.hf_reference import NEW_TOKENS, assert_same_tokens, hf_greedy

# (name, engine overrides, expect preemption)
CONFIGS = [
    ("big-budget", dict(max_num_batched_tokens=4096, num_kv_blocks=512), False),
    ("budget-16", dict(max_num_batched_tokens=16, num_kv_blocks=512), False),
    ("preempting", dict(max_num_batched_tokens=64, num_kv_blocks=None), True),
]


def kv_blocks_to_force_preemption(prompts: list[list[int]], block_size: int) -> int:
    """Enough blocks for the longest request alone, far fewer than all requests together."""
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    return -(-longest // block_size) + 4


def run_engine(model: str, prompts, overrides: dict,
               params: SamplingParams | list[SamplingParams] | None = None
               ) -> tuple[list[list[int]], LLMEngine]:
    """Every prompt through one engine (greedy, NEW_TOKENS, unless `params` say otherwise:
    one SamplingParams for all, or a list, one per prompt)."""
    if overrides.get("num_kv_blocks") is None:
        overrides = {**overrides, "num_kv_blocks": kv_blocks_to_force_preemption(prompts, 16)}
    engine = LLMEngine(EngineArgs(model=model, block_size=16, **{"dtype": "float32", "quantization": "none", **overrides}), progress=False)
    params = params or SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    results = engine.generate(prompts, params if isinstance(params, list)
                              else [params] * len(prompts))
    engine.scheduler.block_manager.check_integrity()
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_total_blocks
    return [r.token_ids for r in results], engine


def check_parity(model_path: str, prompts, refs, name, overrides, expect_preemption):
    ours, engine = run_engine(model_path, prompts, dict(overrides))
    if expect_preemption:
        assert engine.scheduler.num_preemptions_total > 0, "the small KV pool did not preempt"
    for k, (o, (r, logits)) in enumerate(zip(ours, refs)):
        assert_same_tokens(o, r, logits, f"{name} prompt {k}")


# ---- (a) a tiny random Llama with GQA, written as a safetensors directory -------------------

def tiny_llama_and_hf(tmp_path_factory):
    """A tiny random Llama directory and transformers' float32 model of it."""
    from transformers import AutoModelForCausalLM
    path = str(write_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0))
    return path, AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def random_prompts(vocab_size: int, seed: int, lengths) -> list[list[int]]:
    """Prompts of the given lengths, token ids drawn past the special ones (0-2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = tiny_llama_and_hf(tmp_path_factory)
    prompts = random_prompts(hf.config.vocab_size, 1, [3, 9, 17, 30, 45, 64, 81, 120])
    refs = [hf_greedy(hf, p, hf.config.eos_token_id) for p in prompts]
    return path, prompts, refs


@pytest.mark.parametrize("name,overrides,expect_preemption", CONFIGS)
def test_tiny_llama_matches_transformers(tiny, name, overrides, expect_preemption):
    path, prompts, refs = tiny
    check_parity(path, prompts, refs, name, {**overrides, "max_model_len": 512}, expect_preemption)


# ---- (b) the default SmolLM2 GGUF, which transformers reads too ------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,overrides,expect_preemption", CONFIGS)
def test_smollm2_gguf_matches_transformers(smollm_chat, name, overrides, expect_preemption):
    prompts, refs = smollm_chat
    check_parity("smollm2-135m", prompts, refs, name, overrides, expect_preemption)


@pytest.mark.slow
def test_smollm2_bf16_tokens_do_not_depend_on_chunking_or_preemption(smollm_chat):
    """The bf16 CPU fast path (attention kernels over the paged cache, prepacked GEMMs, fused
    norm/RoPE/SwiGLU) computes every row the same way whatever shares its iteration: a big
    budget, 16-token chunks beside other requests, and a preempting KV pool give the same
    greedy tokens. (Not compared with transformers: its bf16 rounds differently. torch's own
    ops, the fallback without the kernels, are not batch-invariant: this test fails there.)"""
    from gpu_worker.cpu_kernels import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None or not kernels.paged_prefill_supported(64, 3):
        pytest.skip("no prefill attention kernel here: the torch fallback is not batch-invariant")
    from gpu_worker.model.layers import prepack
    if prepack(torch.zeros(16, 16, dtype=torch.bfloat16)) is None:
        pytest.skip("no oneDNN bf16 linear prepack here (no AVX-512 BW/VL/DQ): torch's bf16 "
                    "GEMMs are not batch-invariant")
    if amx_in_use():
        pytest.skip("oneDNN's AMX bf16 GEMMs block rows by batch size: a row's bits depend on "
                    "the batch (2-4x faster than without AMX, so they stay on)")
    prompts, _ = smollm_chat
    outs = {}
    for name, overrides, expect_preemption in CONFIGS:
        outs[name], engine = run_engine("smollm2-135m", prompts, {**overrides, "dtype": "bfloat16"})
        assert not expect_preemption or engine.scheduler.num_preemptions_total > 0, name
    for name, tokens in outs.items():
        assert tokens == outs["big-budget"], name


def amx_in_use() -> bool:
    """Whether oneDNN runs bf16 GEMMs on AMX tiles here (unless ONEDNN_MAX_CPU_ISA caps it)."""
    from shared.cpu import cpu_flags
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return "amx_bf16" in cpu_flags() and (cap == "ALL" or "AMX" in cap)
