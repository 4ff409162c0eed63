"""Data-parallel replicas served with real processes (docs/design.md#cache-aware-routing):
`pacer up --replicas 2` runs two engine instances, each its own scheduler and worker and the
only consumer of its own request stream in a real Redis, behind one gateway whose prefix
router sends requests sharing a prefix to the replica that holds it. Greedy float32 output
equals transformers' whichever replica serves it."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from shared.keys import Keys
from shared.protocol import from_fields
from tests.helpers_tiny_model import greedy_token_names, write_tiny_llama
from tests.served_fixture import completion, start_served, wait_for

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
PREFIX_A = [(7 * i) % 200 + 10 for i in range(96)]          # 6 full blocks of 16
PREFIX_B = [(11 * i + 3) % 200 + 10 for i in range(96)]
A = [PREFIX_A + [30 + i, 40 + i, 50 + i, 60 + i, 70] for i in range(4)]
B = [PREFIX_B + [31 + i, 41 + i, 51 + i] for i in range(4)]
# one after another, families interleaved so that round-robin would split each of them
ORDER = [A[0], A[1], B[0], B[1], A[2], B[2], B[3], A[3]]
REPLICAS = [Keys().for_instance("r0"), Keys().for_instance("r1")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=7)


@pytest.fixture(scope="module")
def expected(tiny) -> dict[tuple[int, ...], list[str]]:
    return greedy_token_names(tiny, A + B, NEW_TOKENS)


def complete(base_url: str, model: str, prompt: list[int]) -> list[str]:
    return completion(base_url, model, prompt, NEW_TOKENS, timeout_s=120,
                      return_tokens_as_token_ids=True)["logprobs"]["tokens"]


def served_by(r: redis.Redis) -> dict[tuple[int, ...], set[str]]:
    """prompt -> the replicas whose own request stream carried it."""
    out: dict[tuple[int, ...], set[str]] = {}
    for keys in REPLICAS:
        for _, fields in r.xrange(keys.instance_requests):
            out.setdefault(tuple(from_fields(fields).prompt_token_ids), set()).add(keys.instance)
    return out


def stats(r: redis.Redis, keys: Keys) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in r.hgetall(keys.stats).items()}


def test_prefix_routing_keeps_a_prefix_on_one_replica_and_output_exact(tiny, expected, tmp_path):
    model = "tiny"
    served = start_served(str(tmp_path / "up.log"), "--model", tiny, "--dtype", "float32",
                          "--max-model-len", "512", "--served-model-name", model,
                          "--kv-cache-memory", "16MiB", "--replicas", "2")
    r = redis.Redis.from_url(served.redis_url)
    try:
        # the banner names the model as clients must send it
        wait_for(lambda: f"pacer up: serving {model} at {served.base_url}/v1" in
                 served.log_tail(10**6), 10, "the banner")
        for prompt in ORDER:
            assert complete(served.base_url, model, prompt) == expected[tuple(prompt)]
        by_prompt = served_by(r)
        assert sum(len(v) for v in by_prompt.values()) == len(ORDER)
        for family in (A, B):
            (replica,) = set.union(*(by_prompt[tuple(p)] for p in family))   # one replica
            keys = REPLICAS[int(replica[1])]
            # every request of the family after its first found the 96-token prefix cached
            s = wait_for(lambda: (s := stats(r, keys))["prefix_cache_hits_total"]
                         >= 96 * (len(family) - 1) and s, 10, f"{replica}'s prefix hits")
            assert s["prefix_cache_hits_total"] >= 96 * (len(family) - 1)
            assert r.scard(keys.cached_blocks) >= 6          # what it published
        # each replica is the one consumer of its own stream (redis-cli XINFO GROUPS ...)
        for keys in REPLICAS:
            (group,) = r.xinfo_groups(keys.instance_requests)
            assert group["name"] == b"schedulers" and group["consumers"] == 1
            assert group["pending"] == 0
        assert r.xlen(Keys().requests) == 0                 # nothing went to the shared one
        # all at once: whichever replica serves a prompt, its output is exact
        prompts = A + B
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: complete(served.base_url, model, p), prompts))
        assert got == [expected[tuple(p)] for p in prompts]
        status, body = served.get("/metrics")
        assert status == 200 and b'pacer:prefix_cache_hits_total{instance="r1"}' in body
    finally:
        r.close()
        assert served.stop() == 0, served.log_tail()
