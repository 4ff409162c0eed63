"""Served tensor parallelism with real processes: `pacer up --tp 2` runs two worker ranks
that meet through Redis and talk over torch.distributed (gloo). Greedy output equals the
in-process tp=1 engine's; killing a follower rank takes the group down, `pacer up` restarts
it, and the same request gives the same tokens again."""
from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.keys import Keys
from shared.protocol import decode
from shared.sampling import SamplingParams
from tests.helpers_tiny_model import write_tiny_llama
from tests.served_fixture import completion, read_json, start_served

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 3, 200, 7] * 5]
NEW_TOKENS = 12
DIGITS = "[0-9]{6}"


def complete(base_url: str, model: str, prompt: list[int], **fields) -> list[int]:
    choice = completion(base_url, model, prompt, NEW_TOKENS, **fields)
    return choice["text"], choice["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=3)


def test_tp2_served_matches_in_process_and_survives_a_dead_rank(tiny, tmp_path):
    engine = LLMEngine(EngineArgs(model=tiny, dtype="float32", num_kv_blocks=64), progress=False)
    tok = engine.tokenizer
    results = engine.generate(
        PROMPTS, [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)] * 3)
    # the text, and each token as the gateway's logprobs show it (its own decode)
    # and under a grammar (each rank masks by its own matcher)
    results += engine.generate(PROMPTS[:1], [SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, structured_outputs={"regex": DIGITS})])
    expected = [(tok.decode(r.token_ids), [tok.decode([t]) for t in r.token_ids]) for r in results]
    assert len(expected[-1][0]) == 6 and expected[-1][0].isdigit()
    model = os.path.basename(tiny)
    served = start_served(str(tmp_path / "up.log"), "--model", tiny, "--tp", "2", "--dtype", "float32",
                          "--max-model-len", "512", "--served-model-name", model)
    try:
        assert [complete(served.base_url, model, p) for p in PROMPTS] == expected[:3]
        text, tokens = complete(served.base_url, model, PROMPTS[0], ignore_eos=False,
                                structured_outputs={"regex": DIGITS})
        assert (text, tokens[:6]) == (expected[3][0], expected[3][1][:6])    # then the EOS

        r = redis.Redis.from_url(served.redis_url)
        try:
            follower = decode(r.get(Keys().hb_worker(1))).extra["pid"]
        finally:
            r.close()
        os.kill(follower, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 120
        while served.get("/health")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert served.get("/health")[0] != 200, "health stayed 200 after a rank died"
        while time.monotonic() < deadline:
            status, body = served.get("/health")
            if status == 200:
                break
            time.sleep(0.2)
        assert status == 200, read_json(body)
        print(f"\ntp=2 group back {time.monotonic() - killed:.1f} s after rank 1 was killed")
        assert [complete(served.base_url, model, p) for p in PROMPTS] == expected[:3]
        # the scheduler, idle when the group went, noticed the new one before planning for it:
        # no plan relied on a prefix cached in the old group's KV (which kills the new group)
        log_text = served.log_tail(10**8)
        assert "never wrote" not in log_text and log_text.count("restarted worker rank 0") == 1
    finally:
        stopped = time.monotonic()
        assert served.stop() == 0, served.log_tail()
    # the ranks were stopped together: a follower leaves only when rank 0 ends the group
    assert "did not stop in time" not in served.log_tail(10**8), time.monotonic() - stopped
