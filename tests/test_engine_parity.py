"""Greedy output identical, token for token, to Hugging Face transformers (float32), whatever
the batching: a budget larger than every prompt, a budget of 16 (chunks + piggybacking), and a
KV pool so small that preemption happens."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.helpers_tiny_model import write_tiny_llama

NEW_TOKENS = 32
CHAT_PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List five prime numbers and say why each is prime.",
    "Translate 'good morning, how are you today?' into French, Spanish and German.",
    "You are a careful assistant. Summarise the plot of Romeo and Juliet for a child, "
    "in simple words, and say what lesson the story teaches about rushing into decisions.",
    "Here is some Python code:\n\ndef add(a, b):\n    return a - b\n\nprint(add(2, 3))\n\n"
    "What does it print, what is the bug, and how would you fix it? Answer step by step, "
    "and then write a unit test with pytest that would have caught the bug before release.",
]

# (name, engine overrides, expect preemption)
CONFIGS = [
    ("big-budget", dict(max_num_batched_tokens=4096, num_kv_blocks=512), False),
    ("budget-16", dict(max_num_batched_tokens=16, num_kv_blocks=512), False),
    ("preempting", dict(max_num_batched_tokens=64, num_kv_blocks=None), True),
]


def hf_greedy(model, prompt: list[int], eos: int | None) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and the logits it chose from (for near-tie checks)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos if eos is not None else 0, top_p=None, top_k=None,
                         temperature=None, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores)[:, 0]


def assert_same_tokens(ours: list[int], ref: list[int], ref_logits: torch.Tensor, what: str):
    """Exact equality; a divergence is accepted only at a genuine float32 near-tie of the
    reference (top-2 logit gap below 1e-4), and the gap is printed."""
    if ours == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    assert i < len(ours) and i < len(ref), f"{what}: lengths differ {len(ours)} vs {len(ref)}"
    top2 = torch.topk(ref_logits[i], 2).values
    gap = float(top2[0] - top2[1])
    print(f"{what}: diverges at token {i}: ours {ours[i]} vs HF {ref[i]}, HF top-2 gap {gap:.2e}")
    assert gap < 1e-4, f"{what}: token {i} differs ({ours[i]} vs {ref[i]}) with HF logit gap {gap}"


def kv_blocks_to_force_preemption(prompts: list[list[int]], block_size: int) -> int:
    """Enough blocks for the longest request alone, far fewer than all requests together."""
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    return -(-longest // block_size) + 4


def run_engine(model: str, prompts, overrides: dict) -> tuple[list[list[int]], LLMEngine]:
    if overrides.get("num_kv_blocks") is None:
        overrides = {**overrides, "num_kv_blocks": kv_blocks_to_force_preemption(prompts, 16)}
    engine = LLMEngine(EngineArgs(model=model, block_size=16, **{"dtype": "float32", "quantization": "none", **overrides}), progress=False)
    results = engine.generate(prompts, [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)] * len(prompts))
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = tiny_llama_and_hf(tmp_path_factory)
    g = torch.Generator().manual_seed(1)
    vocab = hf.config.vocab_size
    lengths = [3, 9, 17, 30, 45, 64, 81, 120]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    refs = [hf_greedy(hf, p, hf.config.eos_token_id) for p in prompts]
    return path, prompts, refs


@pytest.mark.parametrize("name,overrides,expect_preemption", CONFIGS)
def test_tiny_llama_matches_transformers(tiny, name, overrides, expect_preemption):
    path, prompts, refs = tiny
    check_parity(path, prompts, refs, name, {**overrides, "max_model_len": 512}, expect_preemption)


# ---- (b) the default SmolLM2 GGUF, which transformers reads too ------------------------------

@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from shared.tokenizer import load_tokenizer
    source = resolve_model(None)
    d = tmp_path_factory.mktemp("gguf")
    os.symlink(source.path, d / os.path.basename(source.path))
    hf = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=os.path.basename(source.path),
                                              torch_dtype=torch.float32).eval()
    tok = load_tokenizer(source)
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    refs = [hf_greedy(hf, p, tok.eos_token_id) for p in prompts]
    return prompts, refs


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides,expect_preemption", CONFIGS)
def test_smollm2_gguf_matches_transformers(smollm, name, overrides, expect_preemption):
    prompts, refs = smollm
    check_parity("smollm2-135m", prompts, refs, name, overrides, expect_preemption)


@pytest.mark.slow
def test_smollm2_bf16_tokens_do_not_depend_on_chunking_or_preemption(smollm):
    """The bf16 CPU fast path (attention kernels over the paged cache, prepacked GEMMs, fused
    norm/RoPE/SwiGLU) computes every row the same way whatever shares its iteration: a big
    budget, 16-token chunks beside other requests, and a preempting KV pool give the same
    greedy tokens. (Not compared with transformers: its bf16 rounds differently. torch's own
    ops, the fallback without the kernels, are not batch-invariant: this test fails there.)"""
    from gpu_worker.cpu_kernels import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None or not kernels.paged_prefill_supported(64, 3):
        pytest.skip("no CPU kernels with AVX-512 here: the torch fallback is not batch-invariant")
    if amx_in_use():
        pytest.skip("oneDNN's AMX bf16 GEMMs block rows by batch size: a row's bits depend on "
                    "the batch (2-4x faster than without AMX, so they stay on)")
    prompts, _ = smollm
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
