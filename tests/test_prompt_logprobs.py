"""The prompt's own log-probabilities (OpenAI's `echo` with `logprobs`, what evaluation
harnesses score a continuation with): through the whole engine against transformers' forward
over the prompt (float32), with a large budget, 16-row chunks and a preempting KV pool, and
past a prefix another request has cached."""
from __future__ import annotations

import pytest
import torch

from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.sampling import SamplingParams
from tests.test_engine_parity import (CONFIGS, kv_blocks_to_force_preemption, random_prompts,
                                      tiny_llama_and_hf)

TOP = 3
TOLERANCE = 2e-4          # float32 sums in another order (chunks, batch shapes)


@pytest.fixture(scope="module")
def tiny_with_refs(tmp_path_factory):
    path, hf = tiny_llama_and_hf(tmp_path_factory)
    prompts = random_prompts(hf.config.vocab_size, 3, (2, 19, 40, 77))
    refs = []
    with torch.no_grad():
        for p in prompts:
            logprobs = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
            refs.append(logprobs[:-1])      # row r predicts token r + 1
    return path, prompts, refs


def check(prompt: list[int], got: dict, ref: torch.Tensor, what: str) -> None:
    assert sorted(got) == list(range(1, len(prompt))), what      # every token but the first
    for pos in range(1, len(prompt)):
        entry = got[pos]
        row = ref[pos - 1]
        want = row[prompt[pos]]
        assert abs(entry.logprob - want.item()) < TOLERANCE, (what, pos)
        # its rank among the vocabulary's, where no other logprob is within the tolerance
        if not ((row - want).abs() < TOLERANCE).sum() > 1:
            assert entry.rank == int((row > want).sum()) + 1, (what, pos)
        want_lp, want_ids = row.topk(TOP)
        assert [t for t, _ in entry.top] == want_ids.tolist(), (what, pos)
        assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), want_lp,
                              atol=TOLERANCE)


@pytest.mark.parametrize("config,overrides,expect_preemption", CONFIGS)
def test_prompt_logprobs_equal_transformers(tiny_with_refs, config, overrides,
                                            expect_preemption):
    path, prompts, refs = tiny_with_refs
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=TOP)
    results, engine = _completions(path, prompts, {**overrides, "max_model_len": 512}, params)
    if expect_preemption:
        assert engine.scheduler.num_preemptions_total > 0
    for k, (prompt, c, ref) in enumerate(zip(prompts, results, refs)):
        check(prompt, c.prompt_logprobs, ref, f"{config} prompt {k}")


def test_a_cached_prefix_is_computed_again_for_them(tiny_with_refs):
    """The prefix cache would skip the rows whose logits are needed: a request asking for
    prompt log-probabilities takes none of it (as vLLM), and is not counted as a lookup: the
    hit rate, hits over queries, speaks of the requests that can hit."""
    path, prompts, refs = tiny_with_refs
    engine = LLMEngine(EngineArgs(model=path, block_size=16, dtype="float32",
                                  quantization="none", num_kv_blocks=64), progress=False)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    engine.generate([prompts[3]], [plain])
    engine.generate([prompts[3]], [plain])                     # its blocks are cached now
    blocks = engine.scheduler.block_manager
    assert blocks.prefix_cache_hits > 0
    hits, queries = blocks.prefix_cache_hits, blocks.prefix_cache_queries
    [c] = engine.generate([prompts[3]], [SamplingParams(max_tokens=2, temperature=0.0,
                                                        prompt_logprobs=TOP)])
    assert (blocks.prefix_cache_hits, blocks.prefix_cache_queries) == (hits, queries)
    check(prompts[3], c.prompt_logprobs, refs[3], "after a cached prefix")


def _completions(path, prompts, overrides, params):
    """run_engine's engine, keeping the Completions (run_engine keeps only the token ids)."""
    if overrides.get("num_kv_blocks") is None:
        overrides = {**overrides, "num_kv_blocks": kv_blocks_to_force_preemption(prompts, 16)}
    engine = LLMEngine(EngineArgs(model=path, block_size=16, dtype="float32",
                                  quantization="none", **overrides), progress=False)
    return engine.generate(prompts, [params] * len(prompts)), engine


def test_prompt_logprobs_with_tensor_parallelism(tiny_with_refs):
    """Two ranks, each with half the vocabulary's logits: rank 0's gathered rows."""
    path, prompts, refs = tiny_with_refs
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    with LLMEngine(EngineArgs(model=path, block_size=16, dtype="float32", quantization="none",
                              num_kv_blocks=64, max_num_batched_tokens=32, tp=2),
                   progress=False) as engine:
        results = engine.generate(prompts, [params] * len(prompts))
    for k, (prompt, c, ref) in enumerate(zip(prompts, results, refs)):
        check(prompt, c.prompt_logprobs, ref, f"tp=2 prompt {k}")


def test_scoring_iterations_stay_out_of_the_online_cost_fit(tiny_with_refs):
    """An iteration that scores prompt rows runs the LM head over each: a shape the token-gap
    target's cost model has no term for, so it is not folded into the fit."""
    path, prompts, _ = tiny_with_refs
    engine = LLMEngine(EngineArgs(model=path, block_size=16, dtype="float32", num_kv_blocks=64,
                                  quantization="none", target_tbt_ms="auto"), progress=False)
    cost = engine.scheduler.config.iteration_cost
    engine.generate(prompts, [SamplingParams(max_tokens=1, prompt_logprobs=0)] * len(prompts))
    assert cost.observations == 0
    engine.generate(prompts, [SamplingParams(max_tokens=2, temperature=0.0)] * len(prompts))
    assert cost.observations > 0
