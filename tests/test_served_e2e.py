"""The served system end to end, with real processes: `pacer up` starts redis-server, the
scheduler, a worker and the gateway; the official `openai` client talks to it.

Tests run in file order against one `pacer up`; the last one kills the worker.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest
import redis

from services.up import redis_answers
from shared.keys import Keys
from shared.protocol import TokenBatch, decode
from tests.served_fixture import API_KEY, Served, read_json, served, wait_for  # noqa: F401

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEYS = Keys()
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]


def client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=API_KEY, max_retries=0)


def scheduler_idle(s: Served) -> bool:
    m = s.metrics()
    return m.get("pacer:num_requests_running") == 0 and m.get("pacer:kv_cache_usage_perc") == 0


def stats_hash(s: Served) -> dict[str, float]:
    r = redis.Redis.from_url(s.redis_url)
    try:
        return {k.decode(): float(v) for k, v in r.hgetall(KEYS.stats).items()}
    finally:
        r.close()


def test_openai_client_streams_chat_and_text(served: Served):
    c = client(served)
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0, stream=True)
    chunks = list(chat)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.strip()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    completion = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10,
                                      temperature=0, stream=True,
                                      stream_options={"include_usage": True})
    chunks = list(completion)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert "Paris" in text
    assert 1 <= chunks[-1].usage.completion_tokens <= 10


def test_sixteen_concurrent_streams_complete(served: Served):
    before = stats_hash(served)

    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int, str]:
        stream = await c.completions.create(
            model=MODEL, prompt=f"{PROMPTS[i % 3]} ({i})", max_tokens=16, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage, reason = "", 0, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage, reason

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY,
                                      max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(16)))

    results = asyncio.run(all_of_them())
    assert [(usage, reason) for _, usage, reason in results] == [(16, "length")] * 16
    assert all(text for text, _, _ in results)
    wait_for(lambda: scheduler_idle(served), 5.0, "scheduler idle after 16 streams")
    after = stats_hash(served)
    _report_overhead(before, after)
    # rank 0's forward times reached the scheduler's online cost model (the token-gap target)
    assert after["cost_observations_total"] > before.get("cost_observations_total", 0)
    assert after["cost_fixed_ms"] > 0 and 0 <= after["cost_prediction_error"] < 10
    assert served.metrics()["pacer:iteration_cost_fixed_ms"] == pytest.approx(
        after["cost_fixed_ms"], rel=0.5)
    # rank 0's runner timed its forwards within its busy time; both reach /metrics
    forward = after["worker_forward_seconds_total"] - before.get("worker_forward_seconds_total", 0)
    busy = after["worker_busy_seconds_total"] - before.get("worker_busy_seconds_total", 0)
    assert 0 < forward <= busy
    assert served.metrics()["pacer:worker_forward_seconds_total"] >= forward


def _report_overhead(before: dict[str, float], after: dict[str, float]) -> None:
    """Print what the run cost on the host side (for people; `pytest -s` shows it)."""
    def delta(k: str) -> float:
        return after.get(k, 0.0) - before.get(k, 0.0)
    n = delta("scheduler_overhead_iterations_total")
    wait, busy = delta("worker_plan_wait_seconds_total"), delta("worker_busy_seconds_total")
    publish = delta("worker_publish_seconds_total")
    if n and busy:
        print(f"\n16 streams: {delta('num_iterations_total'):.0f} iterations, scheduler "
              f"overhead {1000 * delta('scheduler_overhead_seconds_total') / n:.2f} ms/iteration; "
              f"worker busy {busy:.2f} s, publishing {publish:.2f} s, waiting for plans "
              f"{wait:.2f} s ({100 * wait / (wait + busy + publish):.1f}% of its time)")


def test_greedy_output_equals_in_process_engine(served: Served):
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    from shared.sampling import SamplingParams

    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), progress=False)
    c = client(served)
    # the last with a logit bias and penalties: they travel through the plan to the sampler
    penalties = [{}] * len(PROMPTS) + [dict(frequency_penalty=0.8, presence_penalty=0.5,
                                            logit_bias={"28": 4.0})]
    for prompt, extra in zip(PROMPTS + PROMPTS[:1], penalties):
        ids = engine.tokenizer.encode(prompt)
        # one request at a time on both sides: the same batches, so the same float sums
        bias = tuple((int(t), b) for t, b in extra.get("logit_bias", {}).items())
        [expected] = engine.generate([ids], [SamplingParams(
            max_tokens=24, temperature=0.0, **{**extra, "logit_bias": bias},
            repetition_penalty=1.2 if extra else 1.0)])
        got = c.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                   **extra, extra_body={"repetition_penalty": 1.2} if extra
                                   else None)
        assert got.usage.completion_tokens == len(expected.token_ids), prompt
        assert got.choices[0].text == engine.tokenizer.decode(expected.token_ids), prompt
        assert got.choices[0].finish_reason == expected.finish_reason, prompt
        if prompt == PROMPTS[0] and not extra:
            plain = expected.token_ids
    assert expected.token_ids != plain          # the penalties changed the first prompt's text


def test_n_samples_are_the_seeded_requests_and_a_prompt_batch_its_prompts(served: Served):
    """Choice j of a seeded request with n samples is the single request seeded seed + j,
    though the n ran in one batch; a batch of prompts answers each as alone."""
    c = client(served)
    sampled = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0)
    together = c.completions.create(**sampled, n=3, seed=11)
    texts = [ch.text for ch in sorted(together.choices, key=lambda ch: ch.index)]
    alone = [c.completions.create(**sampled, seed=11 + j).choices[0].text for j in range(3)]
    assert texts == alone
    assert len(set(texts)) > 1                  # the samples differ
    assert together.usage.completion_tokens == 36
    batch = c.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [ch.text for ch in sorted(batch.choices, key=lambda ch: ch.index)] == [
        c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in PROMPTS[:2]]


def test_min_tokens_holds_the_end_off(served: Served):
    c = client(served)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
               max_tokens=40, temperature=0)
    plain = c.chat.completions.create(**ask)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 20
    held = c.chat.completions.create(**ask, extra_body={"min_tokens": 20})
    assert held.usage.completion_tokens >= 20
    assert held.choices[0].message.content.startswith(plain.choices[0].message.content)


def test_structured_outputs_served_as_in_process(served: Served):
    """A JSON schema through response_format (streamed) gives the in-process engine's text,
    which parses and follows the schema; a choice through vLLM's field; a bad grammar is a
    400 naming the field."""
    import json

    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    from shared.sampling import SamplingParams
    from tests.test_structured_outputs import QUESTION, SCHEMA

    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), progress=False)
    messages = [{"role": "user", "content": QUESTION}]
    [want] = engine.generate([engine.tokenizer.encode_chat(messages)], [SamplingParams(
        max_tokens=48, temperature=0.0, structured_outputs={"json": SCHEMA})])
    c = client(served)
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=48, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city",
                                                                "schema": SCHEMA}}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == engine.tokenizer.decode(want.token_ids)
    assert json.loads(text)["city"] in ("Paris", "Rome")
    assert chunks[-1].choices[0].finish_reason == "stop"
    picked = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}})
    assert picked.choices[0].text in ("Paris", "Lyon")
    with pytest.raises(openai.BadRequestError, match="unclosed character class"):
        c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                             extra_body={"guided_regex": "[a-"})
    # with its top alternatives: the tokens the grammar rules out have a JSON number
    scored = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    forced = scored.choices[0].logprobs.content[-1].top_logprobs    # the end, forced
    assert [t.logprob for t in forced][1:] == [-9999.0] * 2
    # a grammar and bad_words that leave nothing: an error, not a token they forbid
    with pytest.raises(openai.BadRequestError, match="leave no token to generate"):
        c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["yes"], "bad_words": ["yes"]})


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                  "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "properties": {"timezone": {"type": "string",
                                                                   "enum": ["UTC", "CET"]}},
                                       "required": ["timezone"]}}}


def test_tool_calls_by_constrained_decoding(served: Served):
    """A named function and 'required' give tool calls whose arguments follow the tools'
    schemas, streamed or not, alike; 'auto' (the server parses the hermes format) gives the
    model's words, or, where a regex makes it write a call in that format, the call; a
    conversation that carries a call and its result goes on."""
    import json

    c = client(served)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
               tools=[WEATHER, TIME], max_tokens=40, temperature=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = c.chat.completions.create(**ask, tool_choice=named)
    [call] = answer.choices[0].message.tool_calls
    # a forced function ends with "stop", as OpenAI's and vLLM's; "required" and "auto" with
    # "tool_calls"
    assert answer.choices[0].finish_reason == "stop" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Rome", "Oslo") and arguments["unit"] in ("C", "F")
    streamed, names, finishes = "", [], []
    for chunk in c.chat.completions.create(**ask, tool_choice=named, stream=True):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [delta_call.function.name] if delta_call.function.name else []
            streamed += delta_call.function.arguments or ""
        finishes += [chunk.choices[0].finish_reason] if chunk.choices else []
    assert names == ["get_weather"] and streamed == call.function.arguments
    assert finishes[-1] == "stop"
    ask["max_tokens"] = 120                               # a list is longer
    required = c.chat.completions.create(**ask, tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls and all(cl.function.name in ("get_weather", "get_time") for cl in calls)
    assert required.choices[0].finish_reason == "tool_calls"
    streamed = [cl for chunk in c.chat.completions.create(**ask, tool_choice="required",
                                                          stream=True)
                if chunk.choices for cl in chunk.choices[0].delta.tool_calls or []]
    assert [(cl.function.name, cl.function.arguments) for cl in streamed] == \
        [(cl.function.name, cl.function.arguments) for cl in calls]
    auto = c.chat.completions.create(**ask)                  # tool_choice 'auto', the default
    assert auto.choices[0].message.content and not auto.choices[0].message.tool_calls
    hermes = {"structured_outputs": {"regex": (
        r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
        r'"unit": "(C|F)"\}\}</tool_call>')}}
    forced = c.chat.completions.create(**ask, extra_body=hermes)
    [call] = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls"
    assert forced.choices[0].message.content == "Checking." and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    deltas = [chunk.choices[0].delta for chunk in c.chat.completions.create(
        **ask, extra_body=hermes, stream=True) if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert [(tc.function.name, tc.function.arguments) for d in deltas
            for tc in d.tool_calls or []] == [(call.function.name, call.function.arguments)]
    # the call and its result in the history, then an answer in words
    history = ask["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    reply = c.chat.completions.create(**{**ask, "messages": history}, tool_choice="none")
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_responses_api_answers_as_chat_completions_do(served: Served):
    """/v1/responses through the openai client: greedy text and token counts equal to the
    chat endpoint's for the same messages, streamed or not; a text that max_output_tokens
    cuts is "incomplete"; a Pydantic text format parses; a function tool is called and its
    output taken back; what needs a stored response or a hosted tool is a 400."""
    import json

    import pydantic

    c = client(served)
    system, question = "Answer in one short sentence.", "What is the capital of France?"
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": question}],
        max_tokens=40, temperature=0)
    assert chat.choices[0].finish_reason == "stop"
    answer = c.responses.create(model=MODEL, instructions=system, input=question,
                                max_output_tokens=40, temperature=0)
    assert answer.status == "completed" and answer.output_text == chat.choices[0].message.content
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    # the same as a list of input items with text parts, streamed
    items = [{"role": "system", "content": system},
             {"role": "user", "content": [{"type": "input_text", "text": question}]}]
    events = list(c.responses.create(model=MODEL, input=items, max_output_tokens=40,
                                     temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        answer.output_text == events[-1].response.output_text
    # the output text's logprobs, chat's for the same tokens
    scored_chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2)
    scored = c.responses.create(model=MODEL, input=question, max_output_tokens=6,
                                temperature=0, top_logprobs=2)
    mine = scored.output[0].content[0].logprobs
    theirs = scored_chat.choices[0].logprobs.content
    assert [(e.token, len(e.top_logprobs)) for e in mine] == \
        [(e.token, len(e.top_logprobs)) for e in theirs]
    assert [e.logprob for e in mine] == pytest.approx([e.logprob for e in theirs], abs=1e-4)
    cut = c.responses.create(model=MODEL, input=question, max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3

    class City(pydantic.BaseModel):
        name: str
        country: str
    parsed = c.responses.parse(model=MODEL, input="Give a city as JSON.", text_format=City,
                               max_output_tokens=60, temperature=0)
    assert parsed.status == "completed" and parsed.output_parsed.name
    # function tools: a named one (constrained decoding), then its output sent back
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}
    called = c.responses.create(model=MODEL, input="What is the weather in Paris?",
                                tools=[tool], max_output_tokens=40, temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"})
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["unit"] in ("C", "F")
    streamed = list(c.responses.create(model=MODEL, input="What is the weather in Paris?",
                                       tools=[tool], max_output_tokens=40, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       stream=True))
    [done] = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert (done.name, done.arguments) == (call.name, call.arguments)
    follow = c.responses.create(
        model=MODEL, tools=[tool], tool_choice="none", max_output_tokens=20, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert follow.output_text
    for refused in ({"previous_response_id": "resp_1"},
                    {"tools": [{"type": "web_search"}]},
                    {"input": [{"type": "reasoning", "summary": []}]}):
        with pytest.raises(openai.BadRequestError):
            c.responses.create(**{"model": MODEL, "input": question, **refused})
    with pytest.raises(openai.BadRequestError, match="send 'input'"):
        c.responses.create(model=MODEL, input=question, extra_body={"messages": items})


def test_vllm_allowed_ids_bad_words_stop_string_kept_and_prompt_truncated(served: Served):
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model(None))
    c = client(served)
    allowed = tok.encode(" yes no")
    picked = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                  extra_body={"allowed_token_ids": allowed})
    assert picked.choices[0].text.replace(" yes", "").replace(" no", "") == ""
    counted = c.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12,
                                   temperature=0, stop=["5"],
                                   extra_body={"include_stop_str_in_output": True})
    assert counted.choices[0].text.endswith("5") and counted.choices[0].finish_reason == "stop"
    cut = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=2, temperature=0,
                               extra_body={"truncate_prompt_tokens": 4})
    assert cut.usage.prompt_tokens == 4
    ask = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert "Paris" in c.completions.create(**ask).choices[0].text
    assert "Paris" not in c.completions.create(
        **ask, extra_body={"bad_words": ["Paris"]}).choices[0].text


def test_echo_with_logprobs_scores_a_prompt_as_in_process(served: Served):
    """The request evaluation harnesses send to score a text (echo, logprobs, one token):
    the prompt's log-probabilities equal the in-process engine's, through the worker's
    publish and the gateway."""
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    from shared.sampling import SamplingParams

    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), progress=False)
    ids = engine.tokenizer.encode(PROMPTS[2] + " It walked through the quiet town at night.")
    [want] = engine.generate([ids], [SamplingParams(max_tokens=1, temperature=0.0,
                                                    prompt_logprobs=1)])
    got = client(served).completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                            temperature=0, echo=True, logprobs=1)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert got.choices[0].text.startswith(engine.tokenizer.decode(ids))
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(want.prompt_logprobs[pos].logprob, abs=1e-5)
    # max_tokens 0 (vLLM's echo without generation): the prompt and its scores alone
    only = client(served).completions.create(model=MODEL, prompt=ids, max_tokens=0,
                                             temperature=0, echo=True, logprobs=1)
    assert only.choices[0].text == engine.tokenizer.decode(ids)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    assert (only.usage.completion_tokens, only.choices[0].finish_reason) == (0, "length")
    # greedy: where the prompt's token is the model's first choice, it is the top one
    assert sum(lp.token_logprobs[p] == max(lp.top_logprobs[p].values())
               for p in range(1, len(ids))) > 0
    # each token's text_offset is where its text stands in the choice's text, also where a
    # special token (the chat template's) is left out of it or written in it
    turn = engine.tokenizer.encode("<|im_start|>")
    for skip in (True, False):
        got = client(served).completions.create(
            model=MODEL, prompt=turn + ids[:6], max_tokens=4, temperature=0, echo=True,
            logprobs=0, extra_body={"skip_special_tokens": skip, "ignore_eos": True})
        text, lp = got.choices[0].text, got.choices[0].logprobs
        start = engine.tokenizer.decode(ids[:6])
        assert text.startswith(start if skip else "<|im_start|>" + start)
        assert lp.text_offset[1] == (0 if skip else len("<|im_start|>"))
        for token, at in zip(lp.tokens[1:], lp.text_offset[1:]):
            assert text.startswith(token, at), (text, token, at)
    # vLLM's field, on a chat: the template's tokens, each with its rank
    answer = client(served).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=2,
        temperature=0, extra_body={"prompt_logprobs": 1})
    scored = answer.model_extra["prompt_logprobs"]
    assert len(scored) == answer.usage.prompt_tokens and scored[0] is None
    for entries in scored[1:]:
        best = min(entries.values(), key=lambda e: e["rank"])
        assert best["rank"] == 1 and best["logprob"] == max(e["logprob"] for e in entries.values())


def test_a_stop_token_ends_the_stream_with_nothing_after_it(served: Served):
    """The scheduler plans the next iteration before this one's token is known
    (docs/design.md#overlap), so the request's row is already planned when its stop token
    comes: the worker skips it, and the client gets exactly the tokens up to the stop token."""
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    from shared.sampling import SamplingParams

    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), progress=False)
    ids = engine.tokenizer.encode(PROMPTS[2])
    [full] = engine.generate([ids], [SamplingParams(max_tokens=24, temperature=0.0,
                                                    ignore_eos=True)])
    k = next(i for i in range(3, 24) if full.token_ids[i] not in full.token_ids[:i])
    # what the worker publishes, seen on every gateway channel (the gateway trims a token
    # that comes after the finish event, but nothing orders the two publishers)
    r = redis.Redis.from_url(served.redis_url)
    listener = r.pubsub()
    listener.psubscribe(KEYS.tokens("*"))
    assert listener.get_message(timeout=5.0)["type"] == "psubscribe"
    stream = client(served).completions.create(
        model=MODEL, prompt=ids, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "stop_token_ids": [full.token_ids[k]]})
    chunks = list(stream)
    time.sleep(0.5)             # any late token event lands meanwhile
    published = []
    while (message := listener.get_message(timeout=0.1)) is not None:
        if message["type"] == "pmessage" and isinstance(batch := decode(message["data"]),
                                                        TokenBatch):
            published += [e.token_id for e in batch.events]
    listener.close()
    r.close()
    assert published == full.token_ids[:k + 1]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    # the stop token ended it: its text is left out, as vLLM does (not with
    # include_stop_str_in_output)
    assert text == engine.tokenizer.decode(full.token_ids[:k])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == k + 1
    wait_for(lambda: scheduler_idle(served), 10.0, "blocks freed after the stop token")


def test_the_workers_counters_in_metrics_catch_up_once_idle(served: Served):
    """The stats hash (and so /metrics) gets rank 0's counters with a result at most every
    0.1 s; the last iterations before the server goes idle reach it all the same."""
    client(served).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5,
                                      temperature=0)
    r = redis.Redis.from_url(served.redis_url)
    try:
        def caught_up():
            beat = decode(r.get(KEYS.hb_worker(0)))
            done = beat.extra["worker_iterations_total"]
            return stats_hash(served).get("worker_iterations_total") == done and \
                served.metrics().get("pacer:worker_iterations_total") == done
        wait_for(caught_up, 10.0, "the worker's iterations in the stats hash and /metrics")
    finally:
        r.close()


def test_scripts_go_by_digest_and_a_script_flush_mid_stream_loses_no_token(served: Served):
    """Steady serving sends every Lua script by its digest (EVALSHA): before, the worker's
    result script (~1.5 KB), the fenced stats HSET and the gateway's submit went as their
    whole text (EVAL) each time. A SCRIPT FLUSH (as a restart of Redis empties the script
    cache) mid-stream costs no token: each script that found the server without it ran
    once, sent again as its text, and is cached again."""
    from gateway.upstream import _SUBMIT_ONCE
    from gpu_worker.service import _SEND_RESULT

    c = client(served)
    r = redis.Redis.from_url(served.redis_url)

    def text(flush_after: int | None = None) -> str:
        chunks = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        out = ""
        for i, chunk in enumerate(chunks):
            out += chunk.choices[0].text if chunk.choices else ""
            if i == flush_after:
                r.script_flush()
        return out

    try:
        want = text()
        r.config_resetstat()
        assert text() == want
        steady = r.info("commandstats")
        assert "cmdstat_eval" not in steady and steady["cmdstat_evalsha"]["calls"] > 0, steady
        assert text(flush_after=4) == want      # the worker's results met NOSCRIPT
        assert text() == want                   # the gateway's submit too
        reloaded = r.script_exists(_SEND_RESULT.sha, _SUBMIT_ONCE.sha)
    finally:
        r.close()
    assert reloaded == [True, True]


def test_client_disconnect_frees_kv_blocks(served: Served):
    stream = client(served).completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    pieces = []
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if len(pieces) == 3:
            break
    # the request holds blocks while it streams ...
    wait_for(lambda: served.metrics()["pacer:kv_cache_usage_perc"] > 0, 5.0, "blocks in use")
    assert served.metrics()["pacer:num_requests_running"] == 1
    stream.close()
    closed = time.monotonic()
    # ... and gives them back once the client is gone
    wait_for(lambda: scheduler_idle(served), 5.0, "KV blocks freed after disconnect")
    print(f"\nKV blocks freed {time.monotonic() - closed:.2f} s after the client disconnected")


def log_records(s: Served) -> list[dict]:
    """The JSON lines of `pacer up`'s log so far (its banner and redis-server's are text)."""
    with open(s.log_path, encoding="utf-8", errors="replace") as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def logged(s: Served, **fields) -> dict:
    """The first log record with these fields, waited for: a service writes it on its own time."""
    def find():
        return next((r for r in log_records(s)
                     if all(r.get(k) == v for k, v in fields.items())), None)
    return wait_for(find, 10.0, f"a log record with {fields}")


def post(s: Served, path: str, body: dict, headers: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"{s.base_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60.0) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_the_log_follows_a_request_by_its_id_to_its_end(served: Served):
    """An operator's view: the client's X-Request-Id leads to the gateway's id, which the
    scheduler's lines carry too; the gateway's last line of a request says how it ended, how
    long it took and its first token (a failed one: why), timestamps in UTC."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, _, answer = post(served, "/v1/completions", {
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
        {**auth, "X-Request-Id": "log-trace-1"})
    assert status == 200, answer
    ended = logged(served, event="request ended", client_request_id="log-trace-1")
    assert ended["service"] == "gateway" and ended["request_id"] == answer["id"]
    assert ended["finish_reason"] == "length" and ended["output_tokens"] == 4
    assert ended["error"] is None
    assert 0 < ended["ttft_s"] <= ended["e2e_s"]
    finished = logged(served, event="request finished", request_id=answer["id"])
    assert finished["service"] == "scheduler" and finished["finish_reason"] == "length"

    # far more tokens than a CPU makes in the time allowed: it ends with the deadline's error
    status, _, answer = post(served, "/v1/completions", {
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True,
        "timeout": 0.05}, {**auth, "X-Request-Id": "log-trace-2"})
    assert status != 200, answer
    ended = logged(served, event="request ended", client_request_id="log-trace-2")
    assert ended["finish_reason"] == "error" and "deadline" in ended["error"], ended
    assert all(record["timestamp"].endswith("Z") for record in log_records(served))


def test_a_refused_api_key_is_logged_with_the_client_request_id(served: Served):
    """A client with the wrong key is visible in the log as any other refusal (it was not
    logged at all), its X-Request-Id sent back; the key itself never appears."""
    status, headers, answer = post(served, "/v1/completions", {
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4},
        {"Authorization": "Bearer wrong-key", "X-Request-Id": "log-trace-3"})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert headers["X-Request-Id"] == "log-trace-3"
    refused = logged(served, event="request refused", client_request_id="log-trace-3")
    assert refused["status"] == 401 and refused["path"] == "/v1/completions"
    with open(served.log_path, encoding="utf-8", errors="replace") as f:
        assert API_KEY not in f.read()


def test_health_turns_unhealthy_when_worker_killed_then_up_stops_cleanly(served: Served):
    assert served.get("/health")[0] == 200
    r = redis.Redis.from_url(served.redis_url)
    try:
        heartbeat = decode(r.get(KEYS.hb_worker(0)))
    finally:
        r.close()
    os.kill(heartbeat.extra["pid"], signal.SIGKILL)

    def unhealthy():
        status, body = served.get("/health")
        return status != 200 and read_json(body)
    body = wait_for(unhealthy, 15.0, "/health non-200 after the worker died")
    assert "worker rank 0" in body["missing"]

    redis_port = int(served.redis_url.rsplit(":", 1)[1].split("/")[0])
    assert served.stop() == 0, served.log_tail()
    assert not redis_answers("127.0.0.1", redis_port)
