"""Prefix caching changes which rows are computed, never the tokens: greedy float32 output with
caching on equals transformers' (and so the output with caching off) for prompts sharing
prefixes that end on a block boundary and mid-block, a prompt that is entirely a cached prefix,
chunked prefill across the cached/uncached boundary, and preemption in a pool so small that
requests whose blocks others share are preempted and take cached blocks back on return."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.model_runner import UnknownKVCache
from gpu_worker.service import token_batches
from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.plan import IterationPlan, NewRequestData
from shared.protocol import decode, encode
from shared.sampling import SamplingParams
from tests.hf_reference import NEW_TOKENS, assert_same_tokens, hf_greedy
from tests.test_engine_parity import tiny_llama_and_hf

BLOCK = 16

# (name, engine overrides, expect preemption)
CONFIGS = [
    ("big-budget", dict(max_num_batched_tokens=4096, num_kv_blocks=256), False),
    ("budget-16", dict(max_num_batched_tokens=16, num_kv_blocks=256), False),
    ("budget-24-orca", dict(max_num_batched_tokens=24, num_kv_blocks=256,
                            enable_chunked_prefill=False), False),
    ("preempting", dict(max_num_batched_tokens=64, num_kv_blocks=14), True),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = tiny_llama_and_hf(tmp_path_factory)
    g = torch.Generator().manual_seed(2)
    vocab = hf.config.vocab_size

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    system = rand(2 * BLOCK + 8)                 # a "system prompt" of 2.5 blocks
    prompts = [
        system + rand(20),                       # the first: computes and caches 3 blocks
        system + rand(5),                        # shares 40 tokens: 2 full blocks + 8
        system[:2 * BLOCK] + rand(30),           # shares exactly 2 blocks
        system[:2 * BLOCK],                      # the prompt is 2 cached blocks exactly
        system + rand(20)[:1],                   # shares 40 tokens, one of its own
        system[:BLOCK + 3] + rand(40),           # shares 1 block + 3 tokens
        rand(50),                                # shares nothing
        system + rand(45),
    ]
    refs = [hf_greedy(hf, p, hf.config.eos_token_id) for p in prompts]
    return path, prompts, refs


def generate_staged(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """The first prompt alone until it has sampled a token (its blocks are cached), then
    every other prompt at once; each request's generated tokens in prompt order."""
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    engine.add_request(prompts[0], sampling, request_id="0")
    while not tokens["0"]:
        for out in engine.step():
            tokens[out.request_id] += [t.token_id for t in out.new_tokens]
    for i, prompt in enumerate(prompts[1:], start=1):
        engine.add_request(prompt, sampling, request_id=str(i))
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [t.token_id for t in out.new_tokens]
    return [tokens[str(i)] for i in range(len(prompts))]


def run(path: str, prompts, overrides: dict, caching: bool):
    args = EngineArgs(model=path, block_size=BLOCK, dtype="float32", max_model_len=512,
                      enable_prefix_caching=caching, **overrides)
    engine = LLMEngine(args, progress=False)
    outs = generate_staged(engine, prompts)
    bm = engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks
    return outs, engine.scheduler


@pytest.mark.parametrize("name,overrides,expect_preemption", CONFIGS)
def test_prefix_caching_keeps_greedy_tokens(tiny, name, overrides, expect_preemption):
    path, prompts, refs = tiny
    results = {}
    for caching in (True, False):
        outs, sched = run(path, prompts, overrides, caching)
        assert not expect_preemption or sched.num_preemptions_total > 0, "no preemption"
        bm = sched.block_manager
        if caching:
            # prompts 1-5 and 7 share 1-3 full blocks of prompt 0's
            assert bm.prefix_cache_hits >= 6 * BLOCK, bm.prefix_cache_hits
        else:
            assert bm.prefix_cache_hits == bm.prefix_cache_queries == 0
        for k, (ours, (ref, logits)) in enumerate(zip(outs, refs)):
            assert_same_tokens(ours, ref, logits, f"{name} caching={caching} prompt {k}")
        results[caching] = outs
    assert results[True] == results[False]


def test_a_worker_refuses_a_cached_prefix_it_never_wrote(tiny):
    """A restarted worker answering a plan made for the one before must not attend over a
    cache it does not have (it stops instead; the scheduler then recomputes)."""
    path, prompts, _ = tiny
    engine = LLMEngine(EngineArgs(model=path, block_size=BLOCK, dtype="float32",
                                  max_model_len=512, num_kv_blocks=16), progress=False)
    plan = IterationPlan(step=0, new_requests=[NewRequestData(
        "r", prompts[3], len(prompts[3]), SamplingParams(max_tokens=1), block_table=[0, 1],
        num_computed_tokens=BLOCK)], cached_requests=[], num_scheduled_tokens={"r": BLOCK})
    with pytest.raises(UnknownKVCache):
        engine.runner.execute(plan)


def test_the_cached_tokens_sent_with_the_first_token_are_the_first_admissions(tiny):
    """A prompt preempted part-way through its prefill finds its own computed blocks cached
    when it comes back. The usage's cached tokens, which rank 0 sends with the first token
    (and the gateway keeps, being first), are what the cache held at its first admission,
    as its finish event says; the worker sent what the re-admission found. The batch names
    the instance whose workers computed the prompt (the gateway's router remembers the
    prefix there)."""
    path, _, _ = tiny
    engine = LLMEngine(EngineArgs(model=path, block_size=4, dtype="float32", max_model_len=64,
                                  max_num_batched_tokens=9, num_kv_blocks=7), progress=False)
    sent: dict[str, int] = {}
    execute = engine.runner.execute

    def execute_and_send(plan):
        result = execute(plan)
        for batch in token_batches(result, engine.runner.requests, "r1").values():
            batch = decode(encode(batch))                   # as the gateway reads it
            assert batch.instance == "r1" or not batch.cached
            for rid, cached in batch.cached.items():
                sent.setdefault(rid, cached)        # the gateway keeps the first
        return result

    engine.runner.execute = execute_and_send
    add = engine.scheduler.add_request          # with a gateway channel, which rank 0 needs
    add("a", list(range(10, 14)), SamplingParams(max_tokens=20, ignore_eos=True), "gw")
    engine.step()
    add("b", list(range(100, 124)), SamplingParams(max_tokens=2, ignore_eos=True), "gw")
    finished = {}
    while engine.has_unfinished():
        finished |= {o.request_id: o.num_cached_tokens for o in engine.step() if o.finished}
    assert engine.scheduler.num_preemptions_total > 0, "b was never preempted"
    assert finished == {"a": 0, "b": 0} and sent == finished
