"""A randomized differential check against transformers (float32 greedy): each case draws an
engine (block size, a token budget down to 1 and block size - 1, a KV pool from just enough
for the longest request, so that others are preempted, to plenty; prefix caching and chunked
prefill mostly on; max_num_seqs) and a traffic of requests that arrive at random iterations,
some while others are mid-prefill, with prompts that share prefixes of random lengths with
each other, repeat one, are a prefix of one (its whole blocks too), or extend one by its
answer (a conversation's next turn), half of those arriving once that one has ended (its
blocks cached); a few are aborted, never more than the case allows (aborting every request
that runs on would hide one that never ends). Every request that is not aborted gets transformers' tokens
(cut at its max_tokens, its stop token, the context), an aborted one a prefix of them; the
prompt logprobs and sampled logprobs asked for equal transformers'; sampled requests with
penalties ride along unchecked. The fixed configurations are tests/test_engine_parity.py's
and tests/test_prefix_cache_parity.py's; a failing case prints what to replay."""
from __future__ import annotations

import random

import pytest
import torch

from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.sampling import SamplingParams
from tests.hf_reference import NEW_TOKENS, assert_same_tokens, hf_greedy
from tests.test_engine_parity import tiny_llama_and_hf

MAX_MODEL_LEN = 128
CASES = 50
TOLERANCE = 2e-4          # logprobs: float32 sums in another order (chunks, batch shapes)


class References:
    """transformers' greedy tokens (with their logits) and prompt logprobs, once per prompt."""

    def __init__(self, hf):
        self.hf, self.greedy, self.prompt = hf, {}, {}

    def tokens(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        key = tuple(prompt)
        if key not in self.greedy:
            self.greedy[key] = hf_greedy(self.hf, prompt, self.hf.config.eos_token_id)
        return self.greedy[key]

    def prompt_logprobs(self, prompt: list[int]) -> torch.Tensor:
        key = tuple(prompt)
        if key not in self.prompt:
            with torch.no_grad():
                logits = self.hf(torch.tensor([prompt])).logits[0].float()
            self.prompt[key] = torch.log_softmax(logits, dim=-1)
        return self.prompt[key]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = tiny_llama_and_hf(tmp_path_factory)
    return path, hf.config.vocab_size, References(hf)


def draw_prompts(rng: random.Random, vocab: int, refs: References, block: int
                 ) -> tuple[list[list[int]], list[int | None]]:
    """The prompts, and for each the earlier prompt it was drawn from (None for a base's)."""
    def rand(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    longest = MAX_MODEL_LEN - 2
    bases = [rand(rng.randint(1, longest)) for _ in range(3)]
    prompts: list[list[int]] = []
    sources: list[int | None] = []
    for _ in range(rng.randint(1, 9)):
        kind, source = rng.random(), rng.randrange(len(prompts)) if prompts else None
        if kind < 0.35 or not prompts:         # a shared prefix: mid-block, whole blocks, all
            base = rng.choice(bases)
            n = rng.choice([rng.randint(1, len(base)), max(1, len(base) // block * block),
                            len(base)])
            prompt = base[:n] + rand(rng.choice([0, rng.randint(1, 5), rng.randint(1, longest)]))
        elif kind < 0.5:
            prompt = list(prompts[source])
        elif kind < 0.62:                      # a prefix of another: anywhere, or whole blocks
            other = prompts[source]
            whole = len(other) // block * block
            prompt = other[:rng.choice([rng.randint(1, len(other)), whole or len(other)])]
        elif kind < 0.75:                      # the next turn of another's conversation
            other = prompts[source]
            prompt = other + refs.tokens(other)[0] + rand(rng.randint(0, 12))
        else:
            prompt = rand(rng.randint(1, longest))
        if kind < 0.35 or kind >= 0.75:
            source = None
        prompts.append(prompt[:MAX_MODEL_LEN - 1])
        sources.append(source)
    return prompts, sources


def draw_sampling(rng: random.Random, prompt: list[int], refs: References
                  ) -> tuple[str, SamplingParams]:
    """What the request asks for (its kind, to check it by) and its sampling parameters."""
    max_tokens = rng.choice([1, 2, rng.randint(1, NEW_TOKENS), NEW_TOKENS])
    kind = rng.choices(["greedy", "stop", "logprobs", "prompt_logprobs", "sampled"],
                       [45, 15, 15, 15, 10])[0]
    if kind == "stop":
        stop = rng.choice(refs.tokens(prompt)[0])
        return kind, SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=(stop,))
    if kind == "logprobs":
        return kind, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=rng.choice([0, 3]))
    if kind == "prompt_logprobs":
        return kind, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                    prompt_logprobs=rng.choice([0, 2]))
    if kind == "sampled":
        return kind, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=rng.randint(0, 99),
                                    top_k=rng.choice([0, 5]), presence_penalty=1.0,
                                    repetition_penalty=1.3)
    return kind, SamplingParams(max_tokens=max_tokens, temperature=0.0)


def expected_tokens(prompt: list[int], sampling: SamplingParams, refs: References) -> list[int]:
    tokens = refs.tokens(prompt)[0][:min(sampling.max_tokens, MAX_MODEL_LEN - len(prompt))]
    for stop in sampling.stop_token_ids:
        if stop in tokens:
            tokens = tokens[:tokens.index(stop) + 1]
    return tokens


@pytest.mark.parametrize("case", range(CASES))
def test_random_traffic_gives_transformers_tokens(tiny, case):
    path, vocab, refs = tiny
    rng = random.Random(case)
    block = rng.choice([8, 16, 16, 32])
    prompts, sources = draw_prompts(rng, vocab, refs, block)
    whole = len(prompts[0]) // block * block
    kept = set()              # never aborted: a request that hangs must fail the case
    if whole and rng.random() < 0.4:      # the first's whole blocks, once they are cached
        prompts.append(prompts[0][:whole])
        sources.append(0)
        kept.add(str(len(prompts) - 1))
    requests = [draw_sampling(rng, p, refs) for p in prompts]
    longest = max(-(-min(len(p) + sp.max_tokens, MAX_MODEL_LEN) // block)
                  for p, (_, sp) in zip(prompts, requests))
    chunked = rng.random() < 0.9
    args = dict(block_size=block, enable_chunked_prefill=chunked,
                max_num_batched_tokens=rng.choice([1, block - 1, block + 1, 24, 4096])
                if chunked else MAX_MODEL_LEN,
                num_kv_blocks=rng.choice([longest, longest + 2, 4 * longest, 512]),
                enable_prefix_caching=rng.random() < 0.85, max_num_seqs=rng.choice([1, 3, 256]))
    print(f"case {case}: {args}, prompts of {[len(p) for p in prompts]} tokens, "
          f"{[kind for kind, _ in requests]}")
    engine = LLMEngine(EngineArgs(model=path, dtype="float32", quantization="none",
                                  max_model_len=MAX_MODEL_LEN, **args), progress=False)
    # one drawn from another prompt arrives, half the time, once that one has ended (its
    # blocks in the cache); the others at random steps
    arrivals: dict[int, list[int]] = {}
    after: dict[str, list[int]] = {}
    for i, source in enumerate(sources):
        if source is not None and (rng.random() < 0.5 or i == len(prompts) - 1):
            after.setdefault(str(source), []).append(i)
        else:
            arrivals.setdefault(rng.randint(0, 25) if rng.random() < 0.6 else 0, []).append(i)
    tokens = {str(i): [] for i in range(len(prompts))}
    logprobs = {str(i): [] for i in range(len(prompts))}
    prompt_logprobs = {str(i): {} for i in range(len(prompts))}
    finished, aborted, added = {}, set(), []
    max_aborts = rng.choice([0, 1, 2, len(prompts)])
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        assert step < 5000, f"case {case}: still unfinished after {step} steps"
        for i in arrivals.get(step, []):
            added.append(engine.add_request(prompts[i], requests[i][1], request_id=str(i)))
        running = [rid for rid in added
                   if rid not in finished and rid not in aborted and rid not in kept]
        if running and len(aborted) < max_aborts and rng.random() < 0.03:
            victim = rng.choice(running)
            engine.abort(victim)
            aborted.add(victim)
            arrivals.setdefault(step + 1, []).extend(after.pop(victim, []))
        for out in engine.step():
            assert out.request_id not in finished, f"output after the end of {out.request_id}"
            tokens[out.request_id] += [t.token_id for t in out.new_tokens]
            logprobs[out.request_id] += [t.logprob for t in out.new_tokens]
            if out.prompt_logprobs is not None:
                for pos, entry in out.prompt_logprobs.by_position():
                    prompt_logprobs[out.request_id].setdefault(pos, entry.logprob)
            if out.finished:
                finished[out.request_id] = out.error
                arrivals.setdefault(step + 1, []).extend(after.pop(out.request_id, []))
        step += 1
    bm = engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks

    for i, (prompt, (kind, sampling)) in enumerate(zip(prompts, requests)):
        rid, what = str(i), f"case {case} request {i} ({kind})"
        if kind == "sampled":
            continue
        expected = expected_tokens(prompt, sampling, refs)
        if rid in aborted:
            expected = expected[:len(tokens[rid])]
        else:
            assert finished.get(rid, "unfinished") is None, (what, finished.get(rid))
        assert_same_tokens(tokens[rid], expected, refs.tokens(prompt)[1], what)
        if kind == "logprobs" and tokens[rid] == expected:
            rows = torch.log_softmax(refs.tokens(prompt)[1].float(), dim=-1)
            for k, (token, logprob) in enumerate(zip(tokens[rid], logprobs[rid])):
                assert abs(logprob - rows[k, token].item()) < TOLERANCE, (what, k)
        if kind == "prompt_logprobs" and rid not in aborted:
            rows = refs.prompt_logprobs(prompt)
            assert sorted(prompt_logprobs[rid]) == list(range(1, len(prompt))), what
            for pos, logprob in prompt_logprobs[rid].items():
                assert abs(logprob - rows[pos - 1, prompt[pos]].item()) < TOLERANCE, (what, pos)
    print(f"case {case}: {engine.scheduler.num_preemptions_total} preemptions, "
          f"{bm.prefix_cache_hits} prefix-cache hit tokens, {len(aborted)} aborted")
