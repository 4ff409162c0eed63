"""Prefix caching through the real system: `pacer up`, then two chat requests with the same long
system prompt and different questions; the second finds the shared blocks cached, and
/metrics and the `stats` hash (`redis-cli HGETALL pacer:stats`) count the hits in tokens, and
the answer's usage says how many of its prompt tokens were cached (OpenAI's
`prompt_tokens_details.cached_tokens`). Prints the time to first token of a miss and of a hit."""
from __future__ import annotations

import time

import openai
import pytest
import redis

from shared.keys import Keys
from tests.served_fixture import API_KEY, Served, served, wait_for  # noqa: F401

pytestmark = pytest.mark.slow

SYSTEM = ("You are the support assistant of a small bicycle shop. " * 4 + "Rules: " + " ".join(
    f"Rule {i}: answer politely, mention part number {1000 + i}, and never promise a date."
    for i in range(40)))


def ask(s: Served, question: str) -> tuple[float, int]:
    """Time to first token and the cached prompt tokens of one greedy streamed chat
    completion."""
    c = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=API_KEY, max_retries=0)
    start = time.perf_counter()
    ttft, usage = None, None
    for chunk in c.chat.completions.create(
            model="smollm2-135m", max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": question}]):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - start
        usage = chunk.usage or usage
    return ttft or time.perf_counter() - start, usage.prompt_tokens_details.cached_tokens


def test_a_shared_system_prompt_is_computed_once(served: Served):
    before = served.metrics().get("pacer:prefix_cache_hits_total", 0.0)
    assert not before > 0          # NaN until the scheduler first writes its stats
    miss_ttft, cached = ask(served, "Do you repair tubeless tyres?")
    assert cached == 0
    # the stats hash is written at most every 0.1 s: poll, do not race it
    after_first = wait_for(lambda: (m := served.metrics())["pacer:prefix_cache_queries_total"] > 500
                           and m, 5.0, "the first request's prefix queries in /metrics")
    queried = after_first["pacer:prefix_cache_queries_total"]
    assert after_first["pacer:prefix_cache_hits_total"] == 0
    hit_ttft, cached = ask(served, "Can I rent a bike for a day?")
    m = wait_for(lambda: (m := served.metrics())["pacer:prefix_cache_queries_total"] > queried
                 and m, 5.0, "the second request's prefix queries in /metrics")
    hits = m["pacer:prefix_cache_hits_total"]
    assert hits >= 500, m          # the system prompt's full blocks, minus at most one
    assert cached == hits          # the one request that found them
    r = redis.Redis.from_url(served.redis_url)
    try:
        stats = {k.decode(): float(v) for k, v in r.hgetall(Keys().stats).items()}
    finally:
        r.close()
    assert stats["prefix_cache_hits_total"] == hits
    # a stop string the gateway ends the answer at (before the scheduler's finish event): the
    # cached count came with the first token
    c = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0)
    cut = c.chat.completions.create(
        model="smollm2-135m", max_tokens=16, temperature=0, stop=[" "],
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Can I rent a bike for a week?"}])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.prompt_tokens_details.cached_tokens >= hits
    print(f"\nprefix of {int(queried)} prompt tokens: TTFT miss {miss_ttft * 1000:.0f} ms, "
          f"hit {hit_ttft * 1000:.0f} ms ({int(hits)} tokens cached)")
