"""Presence, frequency and repetition penalties (OpenAI's two, vLLM's third): the sampler's
arithmetic against transformers' repetition processor and the OpenAI formula, greedy output
through the whole engine against transformers generating with the same penalties (float32,
chunked and preempted too), and the API's bounds."""
from __future__ import annotations

import pytest
import torch

from gateway.openai_schema import APIError, parse_chat, parse_completion
from gpu_worker.sampler import Sampler, TokenCounts, apply_penalties
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from tests.hf_reference import NEW_TOKENS, assert_same_tokens
from tests.test_engine_parity import (CONFIGS, kv_blocks_to_force_preemption, random_prompts,
                                      run_engine, tiny_llama_and_hf)


class OpenAIPenalties:
    """The OpenAI formula as a transformers logits processor: each token's logit less
    frequency x its count in the generated text, less presence once if it is there."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        generated = input_ids[0, self.prompt_len:]
        if not len(generated):
            return scores
        counts = torch.bincount(generated, minlength=scores.shape[1]).to(scores.dtype)
        return scores - (counts * self.frequency + (counts > 0).to(scores.dtype) * self.presence)


def test_repetition_penalty_is_transformers_bit_for_bit():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 4
    tokens = [[1, 7, 7, 30], [2, 49, 0], [5]]
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 1.0)]
    got = apply_penalties(logits, {i: (p, TokenCounts(t, 2))
                                   for i, (p, t) in enumerate(zip(params, tokens))
                                   if p.adjusts_logits})
    for i, (p, t) in enumerate(zip(params, tokens)):
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            torch.tensor([t]), logits[i:i + 1].clone())[0] if p.adjusts_logits else logits[i]
        assert torch.equal(got[i], want), i
    assert not torch.equal(got, logits)                     # a copy was changed, not the input


def test_frequency_and_presence_count_the_output_only():
    logits = torch.zeros(1, 8)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # prompt [3, 3, 4], output [3, 5, 5, 5]
    got = apply_penalties(logits, {0: (p, TokenCounts([3, 3, 4, 3, 5, 5, 5], 3))})[0]
    want = torch.zeros(8)
    want[3] = -(0.5 * 1 + 0.25)
    want[5] = -(0.5 * 3 + 0.25)
    assert torch.equal(got, want)                          # token 4, prompt only: untouched


def test_greedy_follows_the_penalized_logits_and_reports_the_models_logprobs():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    p = SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=1)
    out = Sampler().sample(logits, [p], [1], [TokenCounts([2, 0], 1)])[0]   # 0 was generated
    assert out.token_id == 1
    assert out.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))
    assert Sampler().sample(logits, [SamplingParams(temperature=0.0)], [1])[0].token_id == 0


@pytest.mark.parametrize("penalty", [1e-300, 1e-40])
def test_a_penalty_near_zero_draws_the_tokens_seen_not_garbage(penalty):
    """A penalty in range but below float32's (0 there) divided the seen tokens' positive
    logits into inf and an exact 0 into NaN: greedy took the NaN, a draw anything at all.
    Such a penalty is a huge preference for what was seen: the seen positive logits win,
    and a masked token (-inf) stays masked."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0, float("-inf")]])
    seen = [0, 1, 2, 3, 5]                        # token 4 (the best) is not in the text
    greedy = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    assert Sampler().sample(logits, [greedy], [0], [TokenCounts(seen, 5)])[0].token_id == 0
    drawn = [SamplingParams(temperature=t, seed=s, repetition_penalty=penalty)
             for t in (1.0, 1e-5) for s in range(16)]
    got = Sampler().sample(logits.expand(len(drawn), -1), drawn, [0] * len(drawn),
                           [TokenCounts(seen, 5) for _ in drawn])
    assert {t.token_id for t in got} <= {0, 1}


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                 dict(repetition_penalty=0), dict(repetition_penalty=2.5)])
def test_out_of_range_is_refused(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)
    name = next(iter(bad))
    for parse, body in ((parse_completion, {"model": "m", "prompt": "hi"}),
                        (parse_chat, {"model": "m", "messages": [{"role": "user",
                                                                   "content": "hi"}]})):
        with pytest.raises(APIError) as e:
            parse({**body, **bad})
        assert e.value.param == name


def test_the_api_passes_them_on():
    req = parse_completion({"model": "m", "prompt": "hi", "presence_penalty": 0.5,
                            "frequency_penalty": -0.25, "repetition_penalty": 1.2})
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == \
        (0.5, -0.25, 1.2)
    req = parse_completion({"model": "m", "prompt": "hi", "presence_penalty": None})
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0, 0, 1)


# ---- the whole engine against transformers ----------------------------------------------------

PENALTIES = [("repetition", dict(repetition_penalty=1.3)),
             ("frequency+presence", dict(frequency_penalty=0.6, presence_penalty=0.4)),
             ("all three", dict(repetition_penalty=1.15, frequency_penalty=0.3,
                                presence_penalty=-0.2))]
# the rows of one batch, each with its own: none, each of the above, a repetition penalty below 1
MIXED = [("none", {}), *PENALTIES, ("repetition below 1", dict(repetition_penalty=0.8))]


@pytest.fixture(scope="module")
def tiny_with_refs(tmp_path_factory):
    path, hf = tiny_llama_and_hf(tmp_path_factory)
    prompts = random_prompts(hf.config.vocab_size, 2, (5, 23, 40, 71))
    eos = hf.config.eos_token_id
    refs = {}
    for name, kw in MIXED:
        refs[name] = []
        for p in prompts:
            processors = [OpenAIPenalties(len(p), kw.get("frequency_penalty", 0.0),
                                          kw.get("presence_penalty", 0.0))]
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                                                            dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos, top_p=None, top_k=None, temperature=None,
                              repetition_penalty=kw.get("repetition_penalty", 1.0),
                              logits_processor=processors, output_scores=True,
                              return_dict_in_generate=True)
            refs[name].append((out.sequences[0, len(p):].tolist(), torch.stack(out.scores)[:, 0]))
    return path, prompts, refs


@pytest.mark.parametrize("config,overrides,expect_preemption", CONFIGS)
@pytest.mark.parametrize("penalty,kw", PENALTIES)
def test_greedy_with_penalties_matches_transformers(tiny_with_refs, penalty, kw, config,
                                                    overrides, expect_preemption):
    """Greedy tokens equal transformers' under the same penalties (the repetition one through
    its own processor, OpenAI's through the formula above): with a large budget, 16-row
    chunks, and a KV pool small enough to preempt, whose recomputed requests must count
    their earlier output as output."""
    path, prompts, refs = tiny_with_refs
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, **kw)
    ours, engine = run_engine(path, prompts, {**overrides, "max_model_len": 512}, params)
    if expect_preemption:
        assert engine.scheduler.num_preemptions_total > 0
    for k, (o, (r, logits)) in enumerate(zip(ours, refs[penalty])):
        assert_same_tokens(o, r, logits, f"{penalty} {config} prompt {k}")
    plain, _ = run_engine(path, prompts, {**overrides, "max_model_len": 512})
    assert ours != plain                                    # the penalties changed something


def test_penalties_stay_in_their_rows_of_a_batch(tiny_with_refs):
    """Requests with different penalties (and none) batched together each get transformers'
    tokens for their own: with a KV pool small enough to preempt, and again on the same
    engine, the prompts then in the prefix cache (whose tokens the repetition penalty still
    counts)."""
    path, prompts, refs = tiny_with_refs
    jobs = [(k, MIXED[(k + j) % len(MIXED)][0]) for k in range(len(prompts))
            for j in range(len(MIXED))]
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, **dict(MIXED)[name])
              for _, name in jobs]
    batch = [prompts[k] for k, _ in jobs]
    blocks = kv_blocks_to_force_preemption(prompts, 16)
    ours, engine = run_engine(path, batch, dict(max_num_batched_tokens=64,
                                                num_kv_blocks=blocks, max_model_len=512), params)
    assert engine.scheduler.num_preemptions_total > 0
    again = [c.token_ids for c in engine.generate(batch, params)]
    assert engine.scheduler.block_manager.prefix_cache_hits > 0
    for run, tokens in (("first", ours), ("cached", again)):
        for (k, name), o in zip(jobs, tokens):
            assert_same_tokens(o, *refs[name][k], f"{run} run, {name}, prompt {k}")


def test_logit_bias_comes_first_and_can_ban_or_force_a_token():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    force = SamplingParams(temperature=0.0, logit_bias=((3, 100.0),))
    ban = SamplingParams(temperature=0.0, logit_bias=[[0, -100], [1, -100]])   # from the wire
    assert ban.logit_bias == ((0, -100.0), (1, -100.0))
    assert [t.token_id for t in Sampler().sample(logits.repeat(2, 1), [force, ban], [0, 0],
                                                 [TokenCounts([5], 1)] * 2)] == [3, 2]
    both = SamplingParams(logit_bias=((0, 1.0),), repetition_penalty=2.0)
    got = apply_penalties(torch.tensor([[2.0, -1.0]]), {0: (both, TokenCounts([0, 1], 2))})[0]
    assert torch.equal(got, torch.tensor([1.5, -2.0]))     # (2 + 1) / 2, then -1 * 2


def test_a_logit_bias_past_the_logits_touches_no_other_row():
    logits = torch.zeros(2, 4)
    logits[:, 1] = 5.0
    past = SamplingParams(temperature=0.0, logit_bias=((4, 100.0),))     # one past the width
    plain = SamplingParams(temperature=0.0)
    for params in ([past, plain], [plain, past]):
        got = Sampler().sample(logits, params, [0, 0], [TokenCounts([0], 1)] * 2)
        assert [t.token_id for t in got] == [1, 1]


@pytest.mark.parametrize("bias,error", [
    ([1, 2], "must be a object"), ({"x": 1}, "keys must be token ids"),
    ({"-3": 1}, "keys must be token ids"), ({"5": 101}, "in [-100, 100]"),
    ({"5": "1"}, "in [-100, 100]"), ({"5": True}, "in [-100, 100]"),
    # one token under two keys: the biases added up (+250 on token 7 here)
    ({"7": 100, "07": 100, " 7": 50}, "token 7 twice")])
def test_bad_logit_bias_is_refused(bias, error):
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "hi", "logit_bias": bias})
    assert e.value.param == "logit_bias" and error.split()[-1] in str(e.value), str(e.value)


@pytest.mark.parametrize("key", [" 7", "7 ", "7\n", "+7", "-0", "1_0", "7.0", "0x7", "\u0667",
                                 "\uff17", "\u00b2", "", "9" * 5000])
def test_a_logit_bias_key_that_is_not_a_token_id_in_digits_is_refused(key):
    """int() reads each of these as a number (" 7" and "+7" as 7, "-0" as 0, "1_0" as 10, an
    Arabic-Indic or full-width 7 as 7): a bias on a token the client may not have meant. Only
    ASCII digits name a token, online and offline alike, and the error does not repeat a
    key of any length whole."""
    with pytest.raises(APIError, match="keys must be token ids") as e:
        parse_completion({"model": "m", "prompt": "hi", "logit_bias": {key: 5}})
    assert e.value.param == "logit_bias" and len(str(e.value)) < 200, str(e.value)
    with pytest.raises(InvalidRequestError, match="logit_bias must map token ids"):
        SamplingParams(logit_bias={key: 5})


def test_a_token_biased_twice_is_refused_offline_too():
    with pytest.raises(InvalidRequestError, match="token 7 twice"):
        SamplingParams(logit_bias=[[7, 60], [3, 1], [7, 60]])
    with pytest.raises(InvalidRequestError, match="token 7 twice"):
        SamplingParams(logit_bias={"7": 60, "07": 60})


def test_logit_bias_parsed():
    req = parse_completion({"model": "m", "prompt": "hi", "logit_bias": {"7": -100, "3": 2.5}})
    assert sorted(req.logit_bias) == [(3, 2.5), (7, -100.0)]
    assert SamplingParams.from_dict(SamplingParams(logit_bias=req.logit_bias).to_dict()) == \
        SamplingParams(logit_bias=req.logit_bias)


@pytest.mark.parametrize("field,value", [
    ("best_of", 3), ("response_format", {"type": "xml"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("suffix", "end")])
def test_what_would_be_silently_ignored_is_refused(field, value):
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "hi", field: value})
    assert e.value.param == field
    # their neutral values (as clients send by default) are fine
    neutral = {"n": 1, "best_of": 1, "response_format": {"type": "text"}, "tools": [],
               "suffix": None}[field]
    parse_completion({"model": "m", "prompt": "hi", field: neutral, "user": "someone"})


def test_counts_kept_between_steps_equal_counts_rebuilt():
    """TokenCounts brought up to date step by step (as the runner keeps them) gives the
    logits a fresh one gives, repeated tokens and prompt tokens reappearing included."""
    g = torch.Generator().manual_seed(4)
    p = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=-0.3)
    tokens = [3, 9, 3, 11]
    kept = TokenCounts(tokens, 4)
    for step in range(12):
        logits = torch.randn(1, 16, generator=g)
        a = apply_penalties(logits, {0: (p, kept)})
        b = apply_penalties(logits, {0: (p, TokenCounts(list(tokens), 4))})
        assert torch.equal(a, b), step
        tokens.append(int(torch.randint(0, 16, (1,), generator=g)) if step % 3 else 3)


def test_logits_that_are_a_slice_of_a_padded_vocabulary():
    """The LM head's logits can be a column slice (a vocabulary padded for the GEMM)."""
    padded = torch.randn(3, 12)
    logits = padded[:, :10]
    p = SamplingParams(logit_bias=((9, 5.0),), frequency_penalty=1.0)
    got = apply_penalties(logits, {1: (p, TokenCounts([2, 9, 9], 1))})
    want = logits.clone()
    want[1, 9] = want[1, 9] + 5.0 - 2.0                      # the bias, then 2 x frequency
    assert got.shape == (3, 10) and torch.equal(got, want)
