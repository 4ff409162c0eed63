"""vLLM's min_tokens and min_p: the sampler's masks, greedy output through the whole engine
against transformers' `min_new_tokens` (float32, chunked and preempted too), stop strings held
off until min_tokens, and the API's bounds."""
from __future__ import annotations

import math
import random
import re
import sys

import pytest
import torch

from gateway.openai_schema import APIError, parse_chat, parse_completion
from gateway.prompts import sampling_params
from shared.text_output import TextOutput
from gpu_worker.sampler import LOGPROB_FLOOR, Sampler
from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.plan import NO_TOKEN
from shared.detokenizer import IncrementalDetokenizer
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams, choice_seed
from tests.hf_reference import NEW_TOKENS, assert_same_tokens
from tests.test_engine_parity import CONFIGS, random_prompts, run_engine, tiny_llama_and_hf

EOS_BIAS = 100.0      # makes EOS every step's argmax, unless masked


def test_min_tokens_keeps_eos_and_stop_tokens_out_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 3)        # 1 is the best, 2 next
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,), logprobs=0)
    eos = frozenset({1})
    got = Sampler().sample(logits, [p] * 3, [0, 1, 2], eos_token_ids=eos)
    assert [t.token_id for t in got] == [3, 3, 1]           # EOS and the stop token masked
    assert got[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[3].item())
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler().sample(logits[:1], [ignoring], [0], eos_token_ids=eos)[0].token_id == 1


def test_min_p_never_draws_a_token_below_its_share_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(400, 1)
    drawn = {}
    for min_p in (0.0, 0.2):
        params = [SamplingParams(temperature=1.0, min_p=min_p, seed=s) for s in range(400)]
        drawn[min_p] = {t.token_id for t in Sampler().sample(logits, params, [0] * 400)}
    assert drawn[0.0] == {0, 1, 2, 3}
    assert drawn[0.2] == {0, 1, 2}                          # 0.05 < 0.2 x 0.5
    # before top-p, as vLLM: the nucleus of what is left (0.53, 0.84 of it) stops at two
    # tokens where the whole distribution's (0.5, 0.8, 0.95) would need three
    params = [SamplingParams(temperature=1.0, min_p=0.2, top_p=0.83, seed=s) for s in range(400)]
    assert {t.token_id for t in Sampler().sample(logits, params, [0] * 400)} == {0, 1}


@pytest.fixture(scope="module")
def tiny_with_refs(tmp_path_factory):
    """transformers' greedy output with EOS pushed to the top and `min_new_tokens`: it must
    pick the best other token until then, and EOS right after."""
    from transformers import LogitsProcessorList
    path, hf = tiny_llama_and_hf(tmp_path_factory)
    prompts = random_prompts(hf.config.vocab_size, 5, (7, 26, 49))
    eos = hf.config.eos_token_id

    def bias_eos(input_ids, scores):
        scores = scores.clone()
        scores[:, eos] += EOS_BIAS
        return scores

    refs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, min_new_tokens=9, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos, top_p=None, top_k=None,
                          temperature=None, logits_processor=LogitsProcessorList([bias_eos]),
                          output_scores=True, return_dict_in_generate=True)
        refs.append((out.sequences[0, len(p):].tolist(), torch.stack(out.scores)[:, 0]))
    return path, prompts, eos, refs


@pytest.mark.parametrize("config,overrides,expect_preemption", CONFIGS)
def test_greedy_with_min_tokens_matches_transformers(tiny_with_refs, config, overrides,
                                                     expect_preemption):
    path, prompts, eos, refs = tiny_with_refs
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, min_tokens=9,
                            logit_bias=((eos, EOS_BIAS),))
    ours, _ = run_engine(path, prompts, {**overrides, "max_model_len": 512}, params)
    for k, (o, (r, logits)) in enumerate(zip(ours, refs)):
        assert len(o) == 10 and o[-1] == eos, o                  # nine tokens, then EOS
        assert_same_tokens(o, r, logits, f"min_tokens {config} prompt {k}")


def test_a_stop_string_counts_only_from_min_tokens_on(tokenizer):
    ids = tokenizer.encode(" stop here, stop there, and go on")

    def text(min_tokens: int) -> str:
        out = TextOutput(IncrementalDetokenizer(tokenizer, []), ("stop",), min_tokens)
        for t in ids:
            out.add(t)
        out.finish()
        return out.text

    # tokens: " stop", " here", ",", " stop", " there", ...: as vLLM's, a stop string counts
    # where it ends in a token past the first min_tokens (as EOS may come right after them),
    # so the text of those min_tokens tokens is all kept
    assert text(0) == " "
    assert text(1) == " stop here, "                          # the second "stop" counts
    assert text(3) == " stop here, "
    assert text(4) == " stop here, stop there, and go on"     # both within the first 4


def test_min_tokens_one_with_a_stop_string_is_never_an_empty_answer(tokenizer):
    """min_tokens 1 and stop "\n", the answer beginning with a newline: the stop string in
    the first token ended the request with no text at all, what min_tokens is there to
    prevent (vLLM's keeps the first token's text)."""
    out = TextOutput(IncrementalDetokenizer(tokenizer, []), ("\n",), 1)
    for t in tokenizer.encode("\nHi there\nbye"):
        out.add(t)
    out.finish()
    assert (out.text, out.stop_string) == ("\nHi there", "\n")


class _Pieces:
    """A detokenizer whose token i is the text pieces[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


def test_a_stop_string_before_min_tokens_is_not_found_later_whatever_the_other_stops():
    # "o" lies wholly in the first token, within min_tokens: the second token's check must
    # not find it there because a longer stop string widened the search
    out = TextOutput(_Pieces(["Hello", " world"]), ("o", "xyz"), min_tokens=1)
    out.add(0)
    sent = out.take()
    out.add(1)
    sent += out.take(final=True)
    assert (out.text, sent, out.stop_string) == ("Hello w", "Hello w", "o")


def test_the_streamed_text_is_the_final_text_for_any_stops_and_min_tokens():
    rng = random.Random(0)
    for _ in range(3000):
        pieces = ["".join(rng.choice("ab c") for _ in range(rng.randint(0, 3)))
                  for _ in range(rng.randint(1, 10))]
        stops = tuple("".join(rng.choice("ab c") for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 3)))
        out = TextOutput(_Pieces(pieces), stops, rng.randint(0, 3), rng.random() < 0.5)
        sent = ""
        for t in range(len(pieces)):
            out.add(t)
            sent += out.take()
            # what is held is the longest end of the text that begins a stop string
            held = max((k for s in stops for k in range(len(s)) if k <= len(out.text)
                        and out.text.endswith(s[:k])), default=0)
            assert out.stopped or out.text[out.sent:] == out.text[len(out.text) - held:]
        out.finish()
        sent += out.take(final=True)
        assert sent == out.text, (pieces, stops)


def test_a_tokens_work_does_not_grow_with_its_stop_strings_length():
    """The text that may begin a stop string (held back from a stream) was looked for afresh
    after every token, each prefix of each stop string tried: 64 stop strings of 1024
    characters, the most a request may give, took ~8 ms a token on the gateway's event
    loop, every stream stalled meanwhile. Counted in lines of Python run, not in time."""
    import shared.text_output as module

    def lines_run(length: int) -> int:
        stops = tuple(f"{i:02d}" + "x" * (length - 2) for i in range(64))
        out = TextOutput(_Pieces(["word "] * 60), stops)
        sent = []
        for t in range(40):
            out.add(t)
            sent.append(out.take())
        count = 0

        def trace(frame, event, arg):
            nonlocal count
            if frame.f_code.co_filename != module.__file__:
                return None

            def line(frame, event, arg):
                nonlocal count
                count += event == "line"
                return line
            return line
        sys.settrace(trace)
        try:
            for t in range(40, 60):
                out.add(t)
                sent.append(out.take())
        finally:
            sys.settrace(None)
        assert "".join(sent) == "word " * 60      # nothing that begins a stop string held
        return count

    assert lines_run(1024) < 2 * lines_run(8)


@pytest.fixture(scope="module")
def tokenizer():
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model(None))


@pytest.mark.parametrize("body,param", [
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),                     # above the default of 16
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": "0.1"}, "min_p")])
def test_out_of_range_is_refused(tokenizer, body, param):
    with pytest.raises(APIError) as e:
        req = parse_completion({"model": "m", "prompt": "hi", **body})
        sampling_params(req, 2, 512, tokenizer)
    assert e.value.param == param


@pytest.mark.parametrize("body,said", [
    ({"min_tokens": 9, "max_tokens": 8}, "'min_tokens' (9) is above max_tokens (8)"),
    # max_tokens not sent: the error must not say the client sent one
    ({"min_tokens": 17}, "'min_tokens' (17) is above the output's limit (16, the default when "
                         "none is given)")])
def test_min_tokens_above_the_limit_names_the_limit_the_client_set_or_not(tokenizer, body, said):
    with pytest.raises(APIError, match=re.escape(said)):
        sampling_params(parse_completion({"model": "m", "prompt": "hi", **body}), 2, 512,
                        tokenizer)


def test_the_api_passes_them_on():
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                      "min_tokens": 3, "min_p": 0.05})
    assert (req.min_tokens, req.min_p) == (3, 0.05)
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=2, min_tokens=3)
    p = SamplingParams(max_tokens=4, min_tokens=3, min_p=0.1)
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_a_row_with_every_token_masked_gets_no_token_and_finite_logprobs():
    """A grammar that allows only EOS (its mask: -inf elsewhere, applied before the sampler)
    while min_tokens bans EOS, or allowed_token_ids of a banned token alone: nothing to draw,
    greedy or not; the other rows untouched; a masked token's log-probability is a JSON
    number."""
    inf = float("-inf")
    logits = torch.tensor([[inf, 1.0, inf, inf], [5.0, 1.0, 0.5, 3.0], [5.0, 1.0, 0.5, 3.0]])
    ban_eos = dict(min_tokens=2, logprobs=2)
    params = [SamplingParams(temperature=0.0, **ban_eos), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0, seed=3, allowed_token_ids=(1,), **ban_eos)]
    got = Sampler().sample(logits, params, [0, 0, 0], eos_token_ids=frozenset({1}), masked=True)
    assert [t.token_id for t in got] == [NO_TOKEN, 0, NO_TOKEN]
    values = [v for t in got for v in [t.logprob, *(lp for _, lp in t.top_logprobs)]]
    assert all(math.isfinite(v) for v in values) and LOGPROB_FLOOR in values
    # one allowed token left: drawn as before
    ok = SamplingParams(temperature=0.0, allowed_token_ids=(1, 2), min_tokens=2)
    assert Sampler().sample(logits[1:2], [ok], [0], eos_token_ids=frozenset({1}))[0].token_id == 2


def test_a_request_left_no_token_ends_with_an_error_and_frees_its_blocks(tmp_path_factory):
    path, _hf = tiny_llama_and_hf(tmp_path_factory)
    engine = LLMEngine(EngineArgs(model=path, dtype="float32", quantization="none",
                                  block_size=16, num_kv_blocks=64), progress=False)
    with engine:
        eos = next(iter(engine.scheduler.eos_token_ids))
        stuck = SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=(eos,),
                               min_tokens=3)
        plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = engine.generate([[5, 6, 7, 8], [5, 6, 7, 8]], [stuck, plain])
        assert (out[0].finish_reason, out[0].token_ids) == ("error", [])
        assert "leave no token to generate" in out[0].error
        assert (out[1].finish_reason, len(out[1].token_ids)) == ("length", 8)
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks


def test_allowed_token_ids_leave_only_those_to_draw():
    logits = torch.tensor([[5.0, 1.0, 0.5, 3.0]] * 200)
    only = (1, 2)
    greedy = Sampler().sample(logits[:1], [SamplingParams(temperature=0.0,
                                                          allowed_token_ids=only)], [0])
    assert greedy[0].token_id == 1                          # the best of those allowed
    drawn = Sampler().sample(logits, [SamplingParams(temperature=1.0, seed=s,
                                                     allowed_token_ids=only)
                                      for s in range(200)], [0] * 200)
    assert {t.token_id for t in drawn} == {1, 2}
    mixed = Sampler().sample(logits[:2], [SamplingParams(temperature=0.0),
                                          SamplingParams(temperature=0.0, allowed_token_ids=(3,))],
                             [0, 0])
    assert [t.token_id for t in mixed] == [0, 3]            # the other row untouched
    assert SamplingParams.from_dict(SamplingParams(allowed_token_ids=[3, 1, 3]).to_dict()) \
        .allowed_token_ids == (1, 3)


def test_a_stop_string_kept_in_the_text_when_asked(tokenizer):
    ids = tokenizer.encode(" one, two, stop here, three")

    def text(include: bool) -> str:
        out = TextOutput(IncrementalDetokenizer(tokenizer, []), ("stop",), include_stop=include)
        for t in ids:
            out.add(t)
        out.finish()
        return out.text

    assert text(False) == " one, two, "
    assert text(True) == " one, two, stop"


def test_the_token_that_ends_a_request_is_left_out_of_its_text(tokenizer):
    """vLLM's rule: the stop token (or EOS, written out with skip_special_tokens false) that
    ended a request is not in its text, unless include_stop_str_in_output."""
    ids = tokenizer.encode(" one, two.")
    eos = frozenset(tokenizer.eos_token_ids)
    sampling = SamplingParams(stop_token_ids=(ids[-1],))

    def text(ids, include: bool = False, skip_special: bool = True) -> str:
        out = TextOutput(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special),
                         include_stop=include, ends=lambda t: sampling.stops_on(t, eos))
        for t in ids:
            out.add(t)
        out.finish()
        return out.text

    assert text(ids) == " one, two"
    assert text(ids, include=True) == " one, two."
    eos_text = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False)
    assert text(ids[:-1] + [tokenizer.eos_token_id], skip_special=False) == " one, two"
    assert text(ids[:-1] + [tokenizer.eos_token_id], include=True, skip_special=False) \
        == " one, two" + eos_text


def test_truncate_prompt_tokens_keeps_the_last_ones(tokenizer):
    from gateway.prompts import prompt_token_ids
    body = {"model": "m", "prompt": "one two three four five six seven"}
    whole = prompt_token_ids(parse_completion(body), tokenizer, 2048)[0]
    kept = prompt_token_ids(parse_completion({**body, "truncate_prompt_tokens": 3}), tokenizer,
                            2048)[0]
    assert kept == whole[-3:] and len(whole) > 3
    with pytest.raises(APIError, match="truncate_prompt_tokens"):
        parse_completion({**body, "truncate_prompt_tokens": 0})


def test_add_special_tokens_is_what_the_prompt_is_tokenized_with(tmp_path):
    """vLLM's add_special_tokens: a completions prompt gets the tokenizer's BOS unless it is
    false (it was added whatever was asked), a chat's template only its own unless it is
    true."""
    from gateway.prompts import prompt_token_ids
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    from tests.helpers_tiny_model import write_tiny_gguf, write_tiny_llama
    tok = load_tokenizer(resolve_model(write_tiny_gguf(
        tmp_path / "bos.gguf", write_tiny_llama(tmp_path / "hf"), add_bos_token=True)))
    bos, text = tok.bos_token_id, tok.encode("the cat")
    prompt = {"model": "m", "prompt": "the cat"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "the cat"}]}
    rendered = tok.encode_chat(chat["messages"])
    for body, ids in ((prompt, [bos, *text]),
                      ({**prompt, "add_special_tokens": False}, text),
                      (chat, rendered),
                      ({**chat, "add_special_tokens": True}, [bos, *rendered])):
        parse = parse_chat if "messages" in body else parse_completion
        assert prompt_token_ids(parse(body), tok, 64) == [ids], body
    with pytest.raises(APIError, match="add_special_tokens"):
        parse_completion({**prompt, "add_special_tokens": "no"})


def test_truncate_minus_one_leaves_the_answer_room(tokenizer):
    """-1 (and the Responses API's truncation "auto") cuts a prompt that does not fit down to
    what fits beside the answer, and a request that then passes every length check."""
    from gateway.prompts import prompt_token_ids
    body = {"model": "m", "prompt": " ".join(["word"] * 60), "truncate_prompt_tokens": -1}
    whole = prompt_token_ids(parse_completion({**body, "truncate_prompt_tokens": None}),
                             tokenizer, 2048)[0]
    for extra, room in (({"max_tokens": 5}, 5), ({}, 16)):     # 16: the completions default
        req = parse_completion({**body, **extra})
        [kept] = prompt_token_ids(req, tokenizer, 40)
        assert kept == whole[-(40 - room):]
        assert sampling_params(req, len(kept), 40, tokenizer).max_tokens == room
    assert prompt_token_ids(parse_completion(body), tokenizer, 2048)[0] == whole   # it fits
    chat = {"model": "m", "truncate_prompt_tokens": -1,
            "messages": [{"role": "user", "content": " ".join(["word"] * 60)}]}
    whole = prompt_token_ids(parse_chat({**chat, "truncate_prompt_tokens": None}), tokenizer,
                             2048)[0]
    # without max_tokens a chat prompt that fits stays whole; one that does not keeps 1/8 free
    assert prompt_token_ids(parse_chat(chat), tokenizer, len(whole) + 1)[0] == whole
    req = parse_chat(chat)
    [kept] = prompt_token_ids(req, tokenizer, 64)
    assert kept == whole[-56:] and sampling_params(req, 56, 64, tokenizer).max_tokens == 8


def test_a_bad_word_is_never_completed():
    from gpu_worker.sampler import TokenCounts, bad_word_ends
    assert bad_word_ends([(7,), (3, 4), (1, 3, 5)], [9, 1, 3], 0) == [7, 4, 5]
    assert bad_word_ends([(3, 4)], [9, 3], 1) == [4]
    assert bad_word_ends([(1, 3, 5)], [1, 3], 1) == []         # the 1 is the prompt's
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0, 8.0]] * 2)   # 4 the best, 5 next
    p = SamplingParams(temperature=0.0, bad_words_token_ids=((2, 4),))
    tokens = [[0, 0, 2], [0, 0, 1]]                                # prompt 0, 0; output 2 / 1
    got = Sampler().sample(logits, [p, p], [1, 1], [TokenCounts(t, 2) for t in tokens])
    assert [t.token_id for t in got] == [5, 4]        # after 2, 4 would complete the word


@pytest.mark.slow
def test_bad_words_kept_out_of_greedy_output(tokenizer):
    """In process: the word the model writes first is never completed once it is a bad
    word, and the gateway's tokenizing gives both its forms."""
    from gateway.prompts import bad_words_token_ids
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs

    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), progress=False)
    prompt = engine.tokenizer.encode("The capital of France is")
    [free] = engine.generate([prompt], [SamplingParams(max_tokens=8, temperature=0.0)])
    text = engine.tokenizer.decode(free.token_ids)
    assert "Paris" in text
    words = bad_words_token_ids(("Paris",), engine.tokenizer)
    assert words == (tuple(engine.tokenizer.encode("Paris")),
                     tuple(engine.tokenizer.encode(" Paris")))
    [held] = engine.generate([prompt], [SamplingParams(max_tokens=8, temperature=0.0,
                                                       bad_words_token_ids=words)])
    assert "Paris" not in engine.tokenizer.decode(held.token_ids)


def test_a_max_completion_tokens_below_one_is_named_as_sent():
    with pytest.raises(APIError) as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "max_completion_tokens": 0})
    assert e.value.param == "max_completion_tokens" and "max_completion_tokens" in str(e.value)


def test_a_seed_is_any_64_bit_integer_as_vllm_takes():
    """2**63 - 128 .. 2**63 - 1 (sys.maxsize among them) were refused, to leave room for the
    n choices' seed + j: vLLM takes them, and choice j's seed wraps (`choice_seed`)."""
    for seed in (1_765_051_200_000, -2**63, 2**63 - 128, 2**63 - 1, -1):  # Date.now(), the ends
        assert parse_completion({"model": "m", "prompt": "hi", "seed": seed}).seed == seed
    for seed in (2**63, -2**63 - 1, 2**64):
        with pytest.raises(APIError) as e:
            parse_completion({"model": "m", "prompt": "hi", "seed": seed})
        assert e.value.param == "seed", str(e.value)
        assert "must be a 64-bit integer, from -2**63 to 2**63 - 1" in str(e.value)
        # the offline path (a prompts file's line) refuses it alike: 2**64 gave seed 0's tokens
        with pytest.raises(InvalidRequestError, match=r"seed must be a 64-bit integer"):
            SamplingParams(seed=seed)
    assert [choice_seed(2**63 - 1, j) for j in range(3)] == [2**63 - 1, -2**63, -2**63 + 1]
    assert choice_seed(-1, 1) == 0 and choice_seed(7, 1) == 8
