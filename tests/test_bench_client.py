"""`pacer bench`: seeded workloads, Gamma arrivals, the metric arithmetic on hand-made
timelines, SSE parsing, and real runs against `pacer up` (the whole served system, started by
tests/served_fixture.py). A small aiohttp stand-in server, clearly marked below, covers only
the failure shapes a healthy server never produces on demand (an error mid-stream, a stream
cut before [DONE], a server that never answers)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sys

import numpy as np
import pytest
from aiohttp import web

from services.bench_client import (ApiTarget, RequestResult, SendOptions, _Stream,
                                   arrival_gaps, compute_metrics, error_summary, meets_slos,
                                   parse_goodput, request_body, run_requests, send_offsets)
from services.bench_dataset import (SHAREGPT_MAX_TOTAL, SHAREGPT_PROMPT, BenchRequest,
                                    multi_turn_dataset, random_dataset, shared_prefix_dataset,
                                    sharegpt_like_dataset, sharegpt_like_lengths)
from services.bench_cmd import served_model_name
from services.cli import main as pacer_main
from shared.errors import PacerError
from shared.model_source import resolve_model
from shared.tokenizer import load_tokenizer
from tests.served_fixture import API_KEY, Served, served  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


# ---- datasets ----------------------------------------------------------------------------

@pytest.mark.parametrize("as_ids", [False, True])
def test_random_dataset_is_deterministic_and_exact(tokenizer, as_ids):
    a = random_dataset(tokenizer, 12, 40, 16, 0.0, seed=7, as_token_ids=as_ids)
    b = random_dataset(tokenizer, 12, 40, 16, 0.0, seed=7, as_token_ids=as_ids)
    c = random_dataset(tokenizer, 12, 40, 16, 0.0, seed=8, as_token_ids=as_ids)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert {(r.prompt_len, r.output_len) for r in a} == {(40, 16)}
    for r in a:     # the length claimed is the length the server will see
        ids = r.prompt if as_ids else tokenizer.encode(r.prompt, add_special_tokens=True)
        assert len(ids) == 40


def test_random_dataset_lengths_span_the_range(tokenizer):
    reqs = random_dataset(tokenizer, 60, 100, 50, 0.5, seed=1, as_token_ids=True)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert all(50 <= n <= 150 for n in ins) and all(25 <= n <= 75 for n in outs)
    assert len(set(ins)) > 20          # drawn, not constant
    special = set(tokenizer.backend.get_added_tokens_decoder())
    assert not special & {t for r in reqs for t in r.prompt}


def test_random_dataset_text_prompts_hit_lengths_in_a_range(tokenizer):
    reqs = random_dataset(tokenizer, 20, 64, 8, 0.9, seed=3)
    for r in reqs:
        assert len(tokenizer.encode(r.prompt, add_special_tokens=True)) == r.prompt_len
        assert 6 <= r.prompt_len <= 122


def test_sharegpt_like_lengths_follow_the_documented_distribution():
    draws = sharegpt_like_lengths(np.random.default_rng(0), 20_000)
    assert draws == sharegpt_like_lengths(np.random.default_rng(0), 20_000)
    prompts = np.array([p for p, _ in draws])
    outputs = np.array([o for _, o in draws])
    assert prompts.min() >= 4 and prompts.max() <= SHAREGPT_PROMPT.high
    assert (prompts + outputs).max() <= SHAREGPT_MAX_TOTAL and outputs.min() >= 1
    # means near ShareGPT's 161 / 338 (a little under: the clip cuts the long tail)
    assert 140 < prompts.mean() < 170 and 300 < outputs.mean() < 350
    assert np.median(prompts) < 0.75 * prompts.mean()        # a long right tail


def test_sharegpt_like_dataset_prompts_have_the_drawn_lengths(tokenizer):
    reqs = sharegpt_like_dataset(tokenizer, 10, seed=5, as_token_ids=True)
    drawn = sharegpt_like_lengths(np.random.default_rng(5), 10)
    assert [(r.prompt_len, r.output_len) for r in reqs] == drawn
    assert [len(r.prompt) for r in reqs] == [p for p, _ in drawn]
    fixed = sharegpt_like_dataset(tokenizer, 10, seed=5, output_len=32, as_token_ids=True)
    assert {r.output_len for r in fixed} == {32}
    assert [r.prompt_len for r in fixed] == [r.prompt_len for r in reqs]


# ---- arrivals ----------------------------------------------------------------------------

def test_shared_prefix_dataset_draws_each_prompt_from_a_few_prefixes(tokenizer):
    reqs = shared_prefix_dataset(tokenizer, 40, 4, 64, 16, 8, seed=3, as_token_ids=True)
    assert reqs == shared_prefix_dataset(tokenizer, 40, 4, 64, 16, 8, seed=3, as_token_ids=True)
    prefixes = {tuple(r.prompt[:64]) for r in reqs}
    assert len(prefixes) == 4
    assert all(r.prompt_len == len(r.prompt) == 80 and r.output_len == 8 for r in reqs)
    assert len({tuple(r.prompt[64:]) for r in reqs}) == 40       # every user turn its own
    # as text: the re-encoded prompts of one prefix still share its tokens (but the seam)
    text = shared_prefix_dataset(tokenizer, 12, 2, 64, 16, 8, seed=3)
    encoded = [tokenizer.encode(r.prompt, add_special_tokens=True) for r in text]
    assert all(len(ids) == r.prompt_len for ids, r in zip(encoded, text))
    assert len({tuple(ids[:60]) for ids in encoded}) == 2


def test_multi_turn_dataset_resends_the_history_after_the_previous_turn(tokenizer):
    reqs = multi_turn_dataset(tokenizer, 9, 3, 10, 5, seed=4, as_token_ids=True)
    assert reqs == multi_turn_dataset(tokenizer, 9, 3, 10, 5, seed=4, as_token_ids=True)
    for index, r in enumerate(reqs):
        turn = index // 3
        assert r.prompt_len == len(r.prompt) == 10 * (turn + 1) + 5 * turn
        if turn == 0:
            assert r.after is None
        else:   # its previous turn, then the previous reply, then a new user turn
            assert r.after == index - 3
            assert r.prompt[:reqs[r.after].prompt_len] == reqs[r.after].prompt


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_mean_one_over_rate_and_variance_one_over_b(burstiness):
    rate = 8.0
    gaps = np.array(arrival_gaps(50_000, rate, burstiness, seed=1))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Gamma(b, 1/(rate·b)): variance b·scale² = 1/(rate²·b)
    assert gaps.var() == pytest.approx(1 / (rate ** 2 * burstiness), rel=0.08)
    again = arrival_gaps(100, rate, burstiness, seed=1)
    assert arrival_gaps(100, rate, burstiness, seed=1) == again


def test_infinite_rate_sends_everything_at_once_and_offsets_accumulate_gaps():
    assert send_offsets(5, math.inf) == [0.0] * 5
    gaps = arrival_gaps(6, 2.0, 1.0, seed=4)
    offsets = send_offsets(6, 2.0, 1.0, seed=4)
    assert offsets[0] == 0.0
    assert np.allclose(np.diff(offsets), gaps[:5])
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0)


# ---- metrics on hand-made timelines ------------------------------------------------------

def timeline(ttft, itl, e2el, tokens, prompt=10, ok=True) -> RequestResult:
    return RequestResult(success=ok, prompt_len=prompt, output_tokens=tokens, ttft=ttft,
                         e2el=e2el, itl=list(itl), error="" if ok else "boom")


def test_metrics_on_hand_made_timelines():
    results = [
        timeline(0.1, [0.2, 0.2], 0.5, 3),          # TPOT (0.5-0.1)/2 = 0.2
        timeline(0.2, [0.1, 0.3, 0.2], 0.8, 4),     # (0.8-0.2)/3 = 0.2
        timeline(0.3, [0.4], 0.7, 2),               # 0.4
        timeline(0.4, [], 0.4, 1),                  # one token: no TPOT, no ITL
        timeline(None, [], 9.0, 50, ok=False),      # failed: counted, excluded
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (4, 1)
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 10
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_token_throughput"] == pytest.approx(25.0)
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 300)      # linear interpolation
    assert m["mean_tpot_ms"] == pytest.approx(800 / 3)
    assert m["median_tpot_ms"] == pytest.approx(200.0)
    itl = [200, 200, 100, 300, 200, 400]                               # pooled over requests
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itl))
    assert m["median_itl_ms"] == pytest.approx(200.0)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile(itl, 99))
    assert m["median_e2el_ms"] == pytest.approx(600.0)
    assert "request_goodput" not in m
    assert error_summary(results) == [("boom", 1)]


def test_goodput_counts_requests_meeting_every_slo():
    fast = timeline(0.1, [0.05], 0.15, 2)           # TPOT 50 ms
    slow_first = timeline(3.0, [0.05], 3.05, 2)
    slow_tokens = timeline(0.1, [0.5], 0.6, 2)      # TPOT 500 ms
    one_token = timeline(0.2, [], 0.2, 1)           # no TPOT: only TTFT is judged
    slos = parse_goodput(["ttft:2000", "tpot:200"])
    assert slos == {"ttft": 2000.0, "tpot": 200.0}
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_tokens, one_token)] == \
        [True, False, False, True]
    m = compute_metrics([fast, slow_first, slow_tokens, one_token], 4.0, slos)
    assert m["request_goodput"] == pytest.approx(0.5)
    for bad in (["ttft"], ["latency:5"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_metrics_with_nothing_successful_are_nan_not_an_error():
    m = compute_metrics([timeline(None, [], 0.0, 0, ok=False)], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert math.isnan(m["median_ttft_ms"]) and math.isnan(m["p99_itl_ms"])


# ---- SSE parsing -------------------------------------------------------------------------

def test_stream_parsing_times_only_text_chunks_and_reads_usage():
    r = RequestResult(prompt_len=3, sent_at=10.0)
    s = _Stream(r, chat=True)
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}], "usage": None}
    s.feed(json.dumps(role), 10.5)                  # no text: not the first token
    s.feed(json.dumps({"choices": [{"delta": {"content": "Hi"}}]}), 11.0)
    s.feed(json.dumps({"choices": [{"delta": {"content": " there"}}]}), 11.25)
    s.feed(json.dumps({"choices": [{"delta": {}, "finish_reason": "length"}]}), 11.3)
    s.feed(json.dumps({"choices": [], "usage": {"prompt_tokens": 21, "completion_tokens": 3}}),
           11.3)
    s.feed("[DONE]", 11.3)
    assert r.ttft == pytest.approx(1.0) and r.itl == [pytest.approx(0.25)]
    assert (r.output_tokens, r.prompt_len, s.done, r.error) == (3, 21, True, "")

    r2 = RequestResult(sent_at=0.0)
    s2 = _Stream(r2, chat=False)
    s2.feed(json.dumps({"choices": [{"text": "a"}]}), 0.5)
    s2.feed(json.dumps({"error": {"message": "generation failed: x", "type": "server_error"}}), 0.6)
    assert r2.ttft == 0.5 and r2.error == "generation failed: x"


def test_responses_events_time_text_deltas_and_read_the_last_events_usage():
    r = RequestResult(prompt_len=3, sent_at=10.0)
    s = _Stream(r, chat=False, responses=True)
    started = {"response": {"status": "in_progress", "error": None, "usage": None}}
    s.feed(json.dumps({"type": "response.created", **started}), 10.1)
    s.feed(json.dumps({"type": "response.output_text.delta", "delta": "Hi"}), 11.0)
    s.feed(json.dumps({"type": "response.output_text.delta", "delta": " there"}), 11.5)
    s.feed(json.dumps({"type": "response.output_text.done", "text": "Hi there"}), 11.5)
    assert not s.done
    s.feed(json.dumps({"type": "response.incomplete", "response": {
        "error": None, "usage": {"input_tokens": 30, "output_tokens": 2}}}), 11.5)
    assert r.ttft == pytest.approx(1.0) and r.itl == [pytest.approx(0.5)]
    assert (r.output_tokens, r.prompt_len, s.done, r.error) == (2, 30, True, "")
    r2 = RequestResult(sent_at=0.0)
    s2 = _Stream(r2, chat=False, responses=True)
    s2.feed(json.dumps({"type": "response.failed", "response": {
        "error": {"code": "server_error", "message": "generation failed: x"}}}), 0.5)
    assert s2.done and r2.error == "generation failed: x"
    body = request_body(ApiTarget("http://x", "/v1/responses"), BenchRequest("hi", 1, 4),
                        SendOptions())
    assert (body["input"], body["max_output_tokens"], body["stream"]) == ("hi", 4, True)


def test_stream_with_logprobs_counts_the_tokens_of_each_text_chunk():
    """A character split over two tokens comes in one chunk once whole: it names both."""
    r = RequestResult(sent_at=0.0)
    s = _Stream(r, chat=False)
    s.feed(json.dumps({"choices": [{"text": "a", "logprobs": {"tokens": ["a"]}}]}), 0.5)
    s.feed(json.dumps({"choices": [{"text": "é", "logprobs": {"tokens": ["\\xc3", "\\xa9"]}}]}),
           0.7)
    assert r.chunk_tokens == [1, 2] and r.itl == [pytest.approx(0.2)]
    body = request_body(ApiTarget("http://x"), BenchRequest([1, 2], 2, 4),
                        SendOptions(logprobs=True))
    assert body["logprobs"] == 0
    extra = {"structured_outputs": {"regex": "[a-z]+"}, "temperature": 0.7}
    body = request_body(ApiTarget("http://x"), BenchRequest([1, 2], 2, 4),
                        SendOptions(ignore_eos=False, extra_body=extra))
    assert body["structured_outputs"] == extra["structured_outputs"]
    assert body["temperature"] == 0.7 and body["max_tokens"] == 4     # over the others


# ---- against the real served system (`pacer up`) -----------------------------------------

MODEL = "smollm2-135m"


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions",
                                      "/v1/responses"])
def test_client_measures_a_real_run(served: Served, tokenizer, endpoint):  # noqa: F811
    reqs = random_dataset(tokenizer, 4, 24, 6, 0.0, seed=2)
    target = ApiTarget(served.base_url, endpoint, MODEL, API_KEY)
    results, duration = asyncio.run(run_requests(target, reqs, SendOptions(timeout_s=120.0),
                                                 rate=20.0, max_concurrency=2, seed=0))
    assert [r.error for r in results] == [""] * 4
    for r in results:
        assert r.success and r.output_tokens == 6       # ignore_eos: exactly max_tokens
        assert 0 < r.ttft <= r.e2el <= duration
        assert len(r.itl) >= 1 and r.tpot is not None
        if endpoint == "/v1/completions":
            assert r.prompt_len == 24                    # the usage chunk agrees
        else:
            assert r.prompt_len > 24                     # the chat template adds its tokens
    m = compute_metrics(results, duration)
    assert m["completed"] == 4 and m["total_output_tokens"] == 24


@pytest.mark.slow
def test_token_id_prompts_and_failures_are_counted_not_raised(served: Served,  # noqa: F811
                                                               tokenizer):
    reqs = random_dataset(tokenizer, 2, 16, 4, 0.0, seed=3, as_token_ids=True)
    good = ApiTarget(served.base_url, "/v1/completions", MODEL, API_KEY)
    results, _ = asyncio.run(run_requests(good, reqs, SendOptions(timeout_s=120.0)))
    assert [(r.success, r.prompt_len, r.output_tokens) for r in results] == [(True, 16, 4)] * 2

    wrong_key = ApiTarget(served.base_url, "/v1/completions", MODEL, "not-the-key")
    no_model = ApiTarget(served.base_url, "/v1/completions", "no-such-model", API_KEY)
    for target, status in ((wrong_key, "HTTP 401"), (no_model, "HTTP 404")):
        results, _ = asyncio.run(run_requests(target, reqs, SendOptions(timeout_s=30.0)))
        assert [r.success for r in results] == [False, False]
        assert all(r.error.startswith(status) for r in results), results[0].error


@pytest.mark.slow
def test_a_later_turn_is_sent_after_the_one_it_continues(served: Served,  # noqa: F811
                                                            tokenizer):
    reqs = multi_turn_dataset(tokenizer, 4, 2, 8, 3, seed=6, as_token_ids=True)
    target = ApiTarget(served.base_url, "/v1/completions", "smollm2-135m", API_KEY)
    results, _ = asyncio.run(run_requests(target, reqs, SendOptions(), max_concurrency=4))
    assert all(r.success for r in results), [r.error for r in results]
    for r, req in zip(results, reqs):
        if req.after is not None:
            before = results[req.after]
            assert r.sent_at >= before.sent_at + before.e2el


def test_pacer_bench_command_prints_and_writes_json(served: Served, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "result.json"
    rc = pacer_main(["bench", "--base-url", served.base_url, "--api-key", API_KEY,
                     "--dataset", "sharegpt-like", "--sharegpt-output-len", "4",
                     "--num-prompts", "3", "--request-rate", "50", "--burstiness", "0.5",
                     "--max-concurrency", "2", "--goodput", "ttft:600000",
                     "--result-json", str(out), "--save-detailed"])
    assert rc == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "Serving Benchmark Result" in text and "Median TTFT (ms):" in text
    assert "Prefix cache hit rate (%):" in text        # read from the server's /metrics
    assert f"metrics written to {out}" in captured.err
    data = json.loads(out.read_text())
    assert data["model"] == MODEL and data["completed"] == 3 and data["failed"] == 0
    assert data["total_output_tokens"] == 12
    assert 0.0 <= data["prefix_cache_hit_rate"] <= 100.0
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert data["config"]["request_rate"] == 50.0 and "api_key" not in data["config"]
    assert len(data["requests"]) == 3 and all(r["ttft"] > 0 for r in data["requests"])


def test_prefix_cache_hit_rate_from_pacer_and_vllm_metrics():
    from services.bench_cmd import parse_prefix_cache_counters, prefix_cache_hit_rate
    pacer = ("# TYPE pacer:prefix_cache_hits counter\npacer:prefix_cache_hits_total 64.0\n"
             "pacer:prefix_cache_queries_total 100.0\npacer:num_preemptions_total 3.0\n")
    vllm = ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 214.0\n')
    before, after = parse_prefix_cache_counters(pacer), parse_prefix_cache_counters(vllm)
    assert before == {"prefix_cache_hits_total": 64.0, "prefix_cache_queries_total": 100.0}
    assert prefix_cache_hit_rate(before, after) == pytest.approx(75.0)
    assert parse_prefix_cache_counters("other_total 1.0\n") is None
    assert prefix_cache_hit_rate(None, after) is None
    assert prefix_cache_hit_rate(before, before) is None           # nothing looked up


# ---- failure shapes, against a STAND-IN server (not pacer) -------------------------------
# A few lines of aiohttp that write OpenAI-shaped SSE and then misbehave on purpose.

RELEASE = web.AppKey("release", asyncio.Event)
# what the stand-in streams after its first chunk, by the request's prompt
MIDSTREAM = {
    "error": b'{"error":{"message":"generation failed: worker died"}}',
    "bare error": b'{"error":"Input validation error","error_type":"validation"}',  # TGI's
    "not an object": b"5",
    "odd choices": b'{"choices":[5]}',
    "null usage": b'{"choices":[],"usage":{"completion_tokens":null}}',
    "ok": b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}',
}


async def _standin(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    mode = body["prompt"]
    if mode == "hang":           # answers nothing until the test lets it go
        await request.app[RELEASE].wait()
        return web.Response(status=503)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices":[{"text":"x","index":0}]}\n\n')
    if mode in MIDSTREAM:
        await resp.write(b"data: " + MIDSTREAM[mode] + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    # mode "cut": the stream ends without usage or [DONE]
    await resp.write_eof()
    return resp


STANDIN_KEY = "standin-key"


async def _models(request: web.Request) -> web.Response:
    if request.headers.get("Authorization") != f"Bearer {STANDIN_KEY}":
        return web.json_response({"error": {"message": "invalid API key"}}, status=401)
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})


@contextlib.asynccontextmanager
async def standin_server(handler):
    """The stand-in on a free port, answering /v1/completions with `handler` and /v1/models
    to STANDIN_KEY; yields its app (whose RELEASE event lets a hanging request go) and its
    base URL."""
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_post("/v1/completions", handler)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield app, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        app[RELEASE].set()
        await runner.cleanup()


async def _two_tokens(request: web.Request) -> web.StreamResponse:
    """A whole stream of two tokens, for an 8-token prompt."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in (b'{"choices":[{"text":"a","index":0}]}',
                  b'{"choices":[{"text":"b","index":0}]}',
                  b'{"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":2}}',
                  b"[DONE]"):
        await resp.write(b"data: " + chunk + b"\n\n")
    await resp.write_eof()
    return resp


async def test_failures_midstream_cut_and_timeout_are_recorded():
    async with standin_server(_standin) as (_, base_url):
        target = ApiTarget(base_url, "/v1/completions", "m")
        reqs = [BenchRequest(mode, 1, 4) for mode in ("error", "cut", "hang", "bare error",
                                                      "not an object", "odd choices",
                                                      "null usage", "ok")]
        results, _ = await run_requests(target, reqs, SendOptions(timeout_s=1.0))
    errors = [r.error for r in results]
    assert errors[:4] == ["generation failed: worker died", "the stream ended without [DONE]",
                          "timed out after 1 s", "Input validation error"]
    # a chunk of another shape fails its own request, not the run
    for error, chunk in zip(errors[4:7], ("5", '{"choices":[5]}', '{"choices":[],"usage"')):
        assert error.startswith(f"ValueError: a stream chunk of an unexpected shape: {chunk}"), \
            error
    assert [r.success for r in results] == [False] * 7 + [True]
    m = compute_metrics(results, 1.0)
    assert (m["completed"], m["failed"]) == (1, 7)


async def test_a_refused_api_key_is_named_not_a_missing_model():
    """/v1/models refusing the key said "pass --model", after which every request failed
    with the same 401."""
    async with standin_server(_standin) as (_, base_url):
        assert await asyncio.to_thread(served_model_name, base_url, STANDIN_KEY) == "m"
        for key, problem in ((None, "wants an API key"), ("wrong", "refused the API key")):
            with pytest.raises(PacerError) as e:
                await asyncio.to_thread(served_model_name, base_url, key)
            assert f"{base_url} {problem} (HTTP 401): pass the server's key with --api-key" \
                in str(e.value)


async def test_ctrl_c_mid_run_reports_the_requests_that_ended(tmp_path):
    """SIGINT to `pacer bench` with requests in flight and more to send: it prints and writes
    the metrics of the ones that ended, counts the rest as unfinished, and exits 130 (it
    printed nothing and wrote no file)."""
    seen = []

    async def every_other_hangs(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        if len(seen) % 2 == 0:
            await request.app[RELEASE].wait()
        return await _two_tokens(request)

    out = tmp_path / "result.json"
    async with standin_server(every_other_hangs) as (_, base_url):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "bench", "--base-url", base_url,
            "--model", "m", "--input-len", "8", "--output-len", "2", "--num-prompts", "500",
            "--request-rate", "20", "--result-json", str(out), cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        while len(seen) < 8 and proc.returncode is None:
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 130, stderr.decode()
    assert "interrupted (Ctrl-C)" in stderr.decode() and b"Traceback" not in stderr
    data = json.loads(out.read_text())
    assert data["completed"] >= 1 and data["failed"] == 0
    assert data["completed"] + data["unfinished"] == 500
    assert data["total_output_tokens"] == 2 * data["completed"]
    assert data["duration_s"] > 0 and data["mean_ttft_ms"] > 0
    assert b"Unfinished requests (Ctrl-C):" in stdout and b"Median TTFT (ms):" in stdout


async def test_failed_requests_are_summed_up_in_one_line_and_all_failed_exits_1():
    """A proxy answering some (then all) requests with its HTML error page: the run says how
    many failed and why in one line on stderr; with none succeeding it exits 1 with that line
    as its error. It exited 0 with some failed and nothing on stderr either way, the page's
    lines printed as they came."""
    page = "<html>\n<body>\n  502 Bad Gateway\n</body>\n</html>\n"
    answered, fail_all = [], [False]

    async def proxy(request: web.Request) -> web.StreamResponse:
        answered.append(await request.json())
        if fail_all[0] or len(answered) % 2:
            return web.Response(status=502, text=page, content_type="text/html")
        return await _two_tokens(request)

    async with standin_server(proxy) as (_, base_url):
        for fail_all[0], rc, needle in ((False, 0, "pacer bench: 2 of 4 requests failed"),
                                        (True, 1, "pacer: error: all 4 requests failed")):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.cli", "bench", "--base-url", base_url,
                "--model", "m", "--input-len", "8", "--output-len", "2", "--num-prompts", "4",
                "--max-concurrency", "1", cwd=ROOT,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
            err = stderr.decode()
            assert proc.returncode == rc, err
            [line] = [l for l in err.splitlines() if "requests failed" in l]
            assert line.startswith(needle), err
            assert "with HTTP 502: <html> <body> 502 Bad Gateway </body> </html>" in line, line
            assert "Traceback" not in err and b"Serving Benchmark Result" in stdout


@pytest.mark.parametrize("argv,needle", [
    (["inspect", "plans", "--count", "0"], "--count must be >= 1"),
    (["inspect", "plans", "--redis-url", "redis://:pw@127.0.0.1:1/0"], "cannot reach Redis at redis://:***@"),
    (["inspect", "plans", "--redis-url", "notaurl"], "--redis-url 'notaurl'"),
    (["bench", "--base-url", "notaurl"], "--base-url must be an http"),
    (["bench", "--result-json", "/nonexistent/dir/x.json"], "no folder /nonexistent/dir"),
    (["bench", "--request-timeout", "0"], "--request-timeout must be > 0"),
    (["bench", "--goodput", "ttft:abc"], "must be a number of ms"),
    # NaN passed "<= 0" and ran as if infinite; 0 output tokens silently became 1
    (["bench", "--request-rate", "nan"], "--request-rate must be > 0"),
    (["bench", "--burstiness", "nan"], "--burstiness a finite number > 0; got inf and nan"),
    (["bench", "--dataset", "sharegpt-like", "--sharegpt-output-len", "0"],
     "--sharegpt-output-len must be >= 1, got 0"),
    # a MemoryError traceback, and memory filled drawing arrival times (10**11 of them, or a
    # long-prompt stream of ~4·10**9 over the main one's 4 s)
    (["bench", "--num-prompts", "100000000000"], "--num-prompts must be from 1 to 1,000,000"),
    (["simulate", "--num-requests", "100000000000"], "--num-requests must be from 1 to 1,000,000"),
    (["simulate", "--num-requests", "20", "--long-prompt-rate", "1e9"],
     "--long-prompt-rate 1e+09 over the main stream's 3.98 s is ~3.98e+09 requests"),
    (["simulate", "--block-size", "0"], "--block-size must be from 1 to 65,536 tokens, got 0"),
    # a block bigger than the whole pool was "--kv-cache-memory 60GiB holds no KV block"
    (["simulate", "--block-size", "100000000000000000000"],
     "--block-size must be from 1 to 65,536 tokens, got a 21-digit number"),
    # a value that starts with '-' was argparse's "expected one argument", or an unnamed
    # "cannot read memory size"; now the flag's own check answers it, naming the flag
    (["simulate", "--kv-cache-memory", "-1GiB"],
     "--kv-cache-memory: cannot read memory size '-1GiB'"),
    (["simulate", "--kv-cache-memory=-1GiB"], "--kv-cache-memory: cannot read memory size"),
    (["simulate", "--kv-cache-memory", "auto", "--gpu-memory-utilization", "-1e-3"],
     "--gpu-memory-utilization must be in (0, 1], got -0.001"),
    (["simulate", "--disagg", "1:1", "--fabric", "-1e3"],
     "--fabric '-1e3': a fabric's bandwidth must be from 0.001 to 1e6 GB/s"),
    (["cost", "--transfer", "4096", "--fabric", "-.5"],
     "--fabric '-.5': a fabric's bandwidth must be from 0.001 to 1e6 GB/s"),
    # nothing listens there: it said "pass --model", after which every request failed
    (["bench", "--base-url", "http://127.0.0.1:1"],
     "cannot reach http://127.0.0.1:1 ([Errno 111] Connection refused): is the server running"),
    (["simulate", "--plot", "/nonexistent/x.png"], "no folder /nonexistent"),
])
def test_a_bad_command_line_gets_one_clear_line_before_any_work(argv, needle, capsys):
    assert pacer_main(argv) != 0
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and "pw@" not in err, err
