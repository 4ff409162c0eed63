"""P/D disaggregation served with real processes (docs/design.md#pd-disaggregation): `pacer up
--prefill-workers 1 --decode-workers 1` runs a prefill instance and a decode instance, each
with its own scheduler and workers, a real Redis between them and the Mooncake transfer engine
moving the K/V. Greedy output (float32) equals transformers' on prompts longer than the
prefill budget (so the prefill side chunks), with concurrent streams; a short prompt is
prefilled on the decode instance; the prefill side's blocks are free after the hand-off; and
a killed prefill worker, a killed decode worker or a transfer that never completes each end
with every stream exact."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from scheduler_svc.disagg import INBOX_KEPT_MS
from scheduler_svc.service import HOUSEKEEPING_S
from shared.keys import Keys
from shared.protocol import CancelMsg, ReservedMsg, decode, from_fields, to_fields
from tests.helpers_tiny_model import greedy_token_names, write_tiny_llama
from tests.served_fixture import API_KEY, completion, start_served, wait_for

pytestmark = pytest.mark.slow
pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")

BUDGET = 32                        # --max-num-batched-tokens: the long prompts take 2-3 chunks
LONG = [list(range(20, 20 + n)) for n in (70, 45, 90)] + [[100, 3, 200, 7] * 15]
SHORT = [[5, 6, 7, 8, 9]]           # under --disagg-min-prompt-tokens: prefilled on d0
NEW_TOKENS = 16
LONG_RUN = 200                     # tokens per stream where a process is killed mid-stream
P0, D0 = Keys().for_instance("p0"), Keys().for_instance("d0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture(scope="module")
def expected(tiny) -> dict[tuple[int, ...], list[str]]:
    """transformers' greedy tokens for every prompt (LONG_RUN of them), each as the gateway
    names it; a request for fewer expects the first ones."""
    return greedy_token_names(tiny, LONG + SHORT, LONG_RUN)


def first(expected, prompts, n: int = NEW_TOKENS) -> list[list[str]]:
    return [expected[tuple(p)][:n] for p in prompts]


def complete(base_url: str, model: str, prompt: list[int], n: int = NEW_TOKENS) -> list[str]:
    """The tokens of a streamed completion, as its logprobs name them by id."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {API_KEY}"})
    tokens: list[str] = []
    with urllib.request.urlopen(req, timeout=180) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            tokens += (event["choices"][0].get("logprobs") or {}).get("tokens") or []
    return tokens


def usage_of(base_url: str, model: str, prompt: list[int]) -> dict:
    """The usage of a non-streamed greedy completion of NEW_TOKENS tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=180) as r:
        return json.loads(r.read())["usage"]


def all_concurrently(served, model: str, prompts: list[list[int]],
                     n: int = NEW_TOKENS) -> list[list[str]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(served.base_url, model, p, n), prompts))


def start_pd(tiny: str, tmp_path, *extra: str, env: dict | None = None):
    model = os.path.basename(tiny)
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        served = start_served(str(tmp_path / "up.log"), "--model", tiny, "--dtype", "float32",
                              "--max-model-len", "512", "--served-model-name", model,
                              "--max-num-batched-tokens", str(BUDGET),
                              "--prefill-workers", "1", "--decode-workers", "1",
                              "--disagg-min-prompt-tokens", "16", *extra)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return served, model


def stats(served, keys: Keys) -> dict[str, float]:
    r = redis.Redis.from_url(served.redis_url)
    try:
        return {k.decode(): float(v) for k, v in r.hgetall(keys.stats).items()}
    finally:
        r.close()


def worker_pid(served, keys: Keys, rank: int = 0) -> int:
    r = redis.Redis.from_url(served.redis_url)
    try:
        return decode(r.get(keys.hb_worker(rank))).extra["pid"]
    finally:
        r.close()


def pinned_threads(pid: int) -> list[str]:
    """The CPU lists of a process's threads that may run on fewer cores than it may."""
    def allowed(path: str) -> str:
        with open(path) as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("Cpus_allowed_list:"))
    whole = allowed(f"/proc/{pid}/status")
    return [mask for tid in os.listdir(f"/proc/{pid}/task")
            if (mask := allowed(f"/proc/{pid}/task/{tid}/status")) != whole]


def labelled(served, name: str, instance: str) -> float:
    status, body = served.get("/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(f'{name}{{instance="{instance}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {instance} not in /metrics")


def test_pd_output_equals_transformers_and_frees_prefill_blocks(tiny, expected, tmp_path):
    served, model = start_pd(tiny, tmp_path)
    try:
        prompts = LONG + SHORT
        got = all_concurrently(served, model, prompts)
        assert got == first(expected, prompts)
        # the long prompts went with their K/V, the short one was prefilled on d0
        try:
            p_stats = wait_for(lambda: (s := stats(served, P0)).get("handoffs_total")
                               == len(prompts) and s, 30, "prefill stats")
        except AssertionError:
            raise AssertionError(f"{stats(served, P0)}\n{stats(served, D0)}") from None
        assert p_stats["kv_transfer_bytes_total"] > 0
        assert p_stats["kv_transfer_failures_total"] == 0
        assert p_stats["handoffs_with_kv_total"] == len(LONG)      # SHORT went without
        # every prompt p0 prefilled counted against its TTFT goal (auto by default)
        assert p_stats["ttft_goal_met_total"] + p_stats["ttft_goal_missed_total"] == len(LONG)
        assert "ttft_goal_met_total" not in stats(served, D0)      # the prefill side's goal
        assert stats(served, D0)["handoffs_recomputed_total"] == 0
        # each pool's forward thread on a core of its own (the other threads free)
        if len(os.sched_getaffinity(0)) >= 2:
            cores = [pinned_threads(worker_pid(served, keys)) for keys in (P0, D0)]
            assert all(len(c) == 1 for c in cores), cores
            assert cores[0] != cores[1], cores
        # the prefill side's blocks are free once every request was handed over
        wait_for(lambda: labelled(served, "pacer:kv_cache_usage_perc", "p0") == 0.0, 30,
                 "prefill blocks freed")
        assert labelled(served, "pacer:handoffs_total", "p0") == len(prompts)
        assert labelled(served, "pacer:kv_transfer_bytes_total", "p0") > 0
        # a prompt scored (echo, logprobs): the prefill side computes them, chunked
        assert prompt_logprobs(served, model, LONG[2]) == pytest.approx(
            in_process_prompt_logprobs(tiny, LONG[2]), abs=1e-4)
        # under a grammar: p0 samples the first token through its matcher, d0 makes its own
        # from the tokens handed over
        digits = {"regex": "[0-9]{6}"}
        want, tok = in_process(tiny, LONG[1], max_tokens=12, structured_outputs=digits)
        assert completion(served.base_url, model, LONG[1], 12, ignore_eos=False,
                          structured_outputs=digits)["text"] == tok.decode(want.token_ids)
        assert len(tok.decode(want.token_ids)) == 6
        # min_tokens beyond the first token: p0 samples that one under min_tokens 1 (the whole
        # request's value failed SamplingParams' check there and took p0's scheduler down)
        want, tok = in_process(tiny, LONG[0], max_tokens=12, min_tokens=10)
        assert completion(served.base_url, model, LONG[0], 12, ignore_eos=False,
                          min_tokens=10)["text"] == tok.decode(want.token_ids)
        # stop strings end requests by an abort on d0 while its plans run ahead (their blocks
        # held back from reservations until those plans ran): the long prompts reserved
        # meanwhile still come out exact, the stopped ones end where the string begins
        full = completion(served.base_url, model, SHORT[0], 60)["text"]
        stop = full[len(full) // 2:len(full) // 2 + 3]
        with ThreadPoolExecutor(len(LONG) + 4) as pool:
            stopped = [pool.submit(completion, served.base_url, model, SHORT[0], 60,
                                   stop=[stop]) for _ in range(4)]
            longs = [pool.submit(complete, served.base_url, model, p, 24) for p in LONG]
            assert [f.result() for f in longs] == first(expected, LONG, 24)
            for f in stopped:
                choice = f.result()
                assert (choice["finish_reason"], choice["text"]) == \
                    ("stop", full[:full.index(stop)])
    finally:
        assert served.stop() == 0, served.log_tail()


def prompt_logprobs(served, model: str, prompt: list[int]) -> list[float]:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 0}
    req = urllib.request.Request(f"{served.base_url}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=180) as r:
        logprobs = json.loads(r.read())["choices"][0]["logprobs"]["token_logprobs"]
    assert logprobs[0] is None and len(logprobs) == len(prompt) + 1
    return logprobs[1:len(prompt)]


def in_process(tiny: str, prompt: list[int], **sampling):
    """The in-process engine's greedy Completion of `prompt`, and its tokenizer."""
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    from shared.sampling import SamplingParams
    engine = LLMEngine(EngineArgs(model=tiny, dtype="float32", max_model_len=512,
                                  num_kv_blocks=64), progress=False)
    [c] = engine.generate([prompt], [SamplingParams(temperature=0.0, **sampling)])
    return c, engine.tokenizer


def in_process_prompt_logprobs(tiny: str, prompt: list[int]) -> list[float]:
    c, _ = in_process(tiny, prompt, max_tokens=1, prompt_logprobs=0)
    return [c.prompt_logprobs[pos].logprob for pos in range(1, len(prompt))]


# two families of prompts, each a long shared prefix (6 full blocks of 16) and its own tail
PREFIX_A = [(7 * i) % 200 + 10 for i in range(96)]
PREFIX_B = [(11 * i + 3) % 200 + 10 for i in range(96)]
FAMILIES = [[PREFIX_A + [30 + i, 40 + i, 50 + i, 60 + i, 70] for i in range(3)],
            [PREFIX_B + [31 + i, 41 + i, 51 + i] for i in range(3)]]


def test_two_prefill_instances_the_router_keeps_a_prefix_on_one(tiny, tmp_path):
    """`--prefill-workers 2`: the gateway's router names the prefill instance holding a
    prompt's prefix (its published cached blocks), whichever prefill scheduler reads the
    entry hands it there, and every request of a family after its first finds the 96-token
    prefix cached on that instance; greedy output equals transformers'."""
    prompts = [p for pair in zip(*FAMILIES) for p in pair]           # A0 B0 A1 B1 A2 B2
    want = greedy_token_names(tiny, prompts, NEW_TOKENS)
    served, model = start_pd(tiny, tmp_path, "--prefill-workers", "2")
    r = redis.Redis.from_url(served.redis_url)
    try:
        # Past the start-up window in which the routing hints do not hold yet (a hint, never
        # a wrong token): a prefill scheduler learns its peers from their heartbeats once a
        # housekeeping period (until then it prefills an entry named for a peer itself), and
        # the router learns the block size from the first stats it reads.
        time.sleep(HOUSEKEEPING_S + 0.5)
        complete(served.base_url, model, [(13 * i) % 200 + 5 for i in range(20)])
        for prompt in prompts:                                       # one after another
            assert complete(served.base_url, model, prompt) == want[tuple(prompt)][:NEW_TOKENS]
        chosen: dict[tuple[int, ...], str] = {}
        for _, fields in r.xrange(Keys().requests):
            msg = from_fields(fields)
            chosen[tuple(msg.prompt_token_ids)] = msg.instance
        homes = [{chosen[tuple(p)] for p in family} for family in FAMILIES]
        assert all(len(h) == 1 for h in homes), homes                # one instance a family
        p = {i: Keys().for_instance(i) for i in ("p0", "p1")}
        hits = wait_for(lambda: (h := {i: stats(served, k).get("prefix_cache_hits_total", 0)
                                       for i, k in p.items()})
                        and sum(h.values()) >= 96 * 4 and h, 30, "prefix hits")
        for (home,) in homes:
            assert r.scard(p[home].cached_blocks) >= 6              # what it published
        expected_hits = {i: 96 * 2 * sum(h == {i} for h in homes) for i in p}
        assert hits == expected_hits
        handoffs = sum(stats(served, k).get("handoffs_total", 0) for k in p.values())
        assert handoffs == len(prompts) + 1                          # and the warm-up's
        (home_a,) = homes[0]
        assert labelled(served, "pacer:prefix_cache_hits_total", home_a) >= 96 * 2
        forwarded = sum(labelled(served, "pacer:requests_forwarded_total", i) for i in p)
        assert forwarded <= len(prompts) + 1   # exposed per instance; how many: who read each entry
        # all at once: whichever instance prefills a prompt, its output is exact
        got = all_concurrently(served, model, prompts)
        assert got == [want[tuple(q)][:NEW_TOKENS] for q in prompts]
        # the prefill side's cache hit reaches the client, though the decode side finishes
        assert usage_of(served.base_url, model, FAMILIES[0][1])["prompt_tokens_details"] == \
            {"cached_tokens": 96}
        # every hand-off's K/V arrived whole, those sent from a cached prefix included
        d0 = stats(served, D0)
        assert d0["kv_check_failures_total"] == 0 and d0["handoffs_recomputed_total"] == 0, d0
        # a short prompt, handed over whole as it arrives at an idle instance: counted (the
        # stats of an instance that then stays idle were not written again)
        def handed_over() -> float:
            return sum(stats(served, k).get("handoffs_total", 0) for k in p.values())
        before = handed_over()
        forwarded = sum(stats(served, k).get("requests_forwarded_total", 0) for k in p.values())
        complete(served.base_url, model, SHORT[0])
        wait_for(lambda: handed_over() == before + 1, 10, "the short prompt's hand-off counted")
        # named for no prefill instance (it loads none; a decode instance prefills it), so
        # whoever read it handed it over, with no forward
        named = [from_fields(f).instance for _, f in r.xrange(Keys().requests)
                 if from_fields(f).prompt_token_ids == SHORT[0]]
        assert named == [""]
        assert sum(stats(served, k).get("requests_forwarded_total", 0)
                   for k in p.values()) == forwarded
    finally:
        r.close()
        assert served.stop() == 0, served.log_tail()


def test_pd_prefix_cached_on_the_decode_instance_is_not_sent_again(tiny, tmp_path):
    """A prompt whose 96-token prefix an earlier hand-off left in the decode instance's prefix
    cache: the decode instance reserves new blocks for the rest only, the prefill instance
    sends only those, and greedy output still equals transformers'."""
    prompts = FAMILIES[0]
    want = greedy_token_names(tiny, prompts, NEW_TOKENS)
    served, model = start_pd(tiny, tmp_path)
    try:
        sent = []
        for prompt in prompts:                                       # one after another
            assert complete(served.base_url, model, prompt) == want[tuple(prompt)][:NEW_TOKENS]
            sent.append(wait_for(lambda: (s := stats(served, P0)).get("handoffs_total") ==
                                 len(sent) + 1 and s["kv_transfer_bytes_total"], 30,
                                 "prefill stats"))
        whole, *tails = [b - a for a, b in zip([0.0] + sent, sent)]
        # the first sends its 7 blocks, the others the one past the 6 cached on d0
        assert all(t * 7 == whole for t in tails), (whole, tails)
        d0 = wait_for(lambda: (s := stats(served, D0)).get("prefix_cache_hits_total", 0)
                      >= 96 * 2 and s, 30, "decode prefix hits")
        assert d0["kv_check_failures_total"] == 0 and d0["handoffs_recomputed_total"] == 0, d0
    finally:
        assert served.stop() == 0, served.log_tail()


def test_pd_two_decode_instances_a_prefix_goes_where_it_is_cached(tiny, tmp_path):
    """`--decode-workers 2`: once a prompt's 96-token prefix was handed to one decode
    instance, the prompts sharing it (three at once) go there too, and the prefill instance
    sends each only the block past the 6 cached there; the other decode instance gets none;
    greedy output equals transformers'. Before, the choice went by free blocks alone, and a
    prompt sent to the other instance carried its whole K/V again."""
    prompts = [PREFIX_A + [30 + i, 40 + i, 50 + i, 60 + i, 70] for i in range(4)]
    want = greedy_token_names(tiny, prompts, NEW_TOKENS)
    served, model = start_pd(tiny, tmp_path, "--decode-workers", "2")
    try:
        time.sleep(HOUSEKEEPING_S + 0.5)        # the prefill scheduler has seen both
        assert complete(served.base_url, model, prompts[0]) == want[tuple(prompts[0])][:NEW_TOKENS]
        whole = wait_for(lambda: stats(served, P0).get("kv_transfer_bytes_total"), 30,
                         "the first prompt's K/V sent")
        assert all_concurrently(served, model, prompts[1:]) == \
            [want[tuple(p)][:NEW_TOKENS] for p in prompts[1:]]
        sent = wait_for(lambda: (s := stats(served, P0)).get("handoffs_total") == 4 and s,
                        30, "prefill stats")
        assert sent["kv_transfer_bytes_total"] == whole + 3 * whole / 7, (whole, sent)
        d = {i: stats(served, Keys().for_instance(i)) for i in ("d0", "d1")}
        assert sorted(s.get("handoffs_total", 0) for s in d.values()) == [0, 4], d
        assert all(s["kv_check_failures_total"] == 0 for s in d.values()), d
    finally:
        assert served.stop() == 0, served.log_tail()


def test_pd_ttft_goal_flag_is_taken_and_attainment_counted(tiny, expected, tmp_path):
    """`--target-ttft-ms` reaches the prefill scheduler: with a goal no prompt can meet, each
    one p0 prefills is counted as a miss, in its stats hash and in /metrics; output exact."""
    served, model = start_pd(tiny, tmp_path, "--target-ttft-ms", "0.001")
    try:
        got = all_concurrently(served, model, LONG[:2])
        assert got == first(expected, LONG[:2])
        wait_for(lambda: stats(served, P0).get("ttft_goal_missed_total") == 2, 30,
                 "misses counted")
        assert stats(served, P0)["ttft_goal_met_total"] == 0
        assert labelled(served, "pacer:ttft_goal_missed_total", "p0") == 2
        assert labelled(served, "pacer:ttft_goal_met_total", "p0") == 0
    finally:
        assert served.stop() == 0, served.log_tail()


def test_pd_inboxes_are_trimmed_once_read(tiny, expected, tmp_path):
    """d0's handoff stream and p0's reservations stream keep what their one reader read for
    INBOX_KEPT_MS, not up to HANDOFF_MAXLEN entries, each with its request's prompt: an
    entry from longer before goes once the requests' later ones are read; the latest stay.
    An entry id is its time on Redis' clock, so the earlier entries (a cancel and an answer
    for a request nobody knows, harmless to their reader) are added with ids that far in the
    past: nothing waits the retention out."""
    served, model = start_pd(tiny, tmp_path)
    r = redis.Redis.from_url(served.redis_url)
    try:
        sec, usec = r.time()
        earlier = f"{sec * 1000 + usec // 1000 - INBOX_KEPT_MS - 1000}-0"
        inboxes = {D0.handoff: CancelMsg("nobody's", "a test's"),
                   P0.reservations: ReservedMsg("nobody's", "d0", "nobody", [], [], 0.0,
                                                "a test's")}
        for stream, msg in inboxes.items():
            r.xadd(stream, to_fields(msg, scheduler="a test"), id=earlier)
        assert all_concurrently(served, model, LONG) == first(expected, LONG)
        wait_for(lambda: not any(r.xrange(s, "-", earlier) for s in inboxes), 30,
                 "the inboxes' earlier entries trimmed")
        assert all(r.xlen(s) > 0 for s in inboxes)  # the latest request's, for `pacer inspect`
    finally:
        r.close()
        assert served.stop() == 0, served.log_tail()


def test_pd_decode_side_preemption_recomputes_exactly(tiny, expected, tmp_path):
    """A decode pool too small for its streams' growth (its own, `--decode-kv-cache-memory`,
    beside a larger prefill pool): requests that came with their K/V are preempted there and
    recomputed (prompt + tokens so far) on d0 itself, their streams exact; every block free
    after."""
    # 640 KiB: 40 blocks of the tiny model's 16 KiB; the prefill pool keeps --num-kv-blocks
    served, model = start_pd(tiny, tmp_path, "--num-kv-blocks", "64",
                             "--decode-kv-cache-memory", "640KiB")
    try:
        assert (scheduler_beat(served, "p0")["num_kv_blocks"],
                scheduler_beat(served, "d0")["num_kv_blocks"]) == (64, 40)
        # 245-290 tokens each, 16-19 blocks, 69 together: more than the pool's 40
        got = all_concurrently(served, model, LONG, LONG_RUN)
        assert got == first(expected, LONG, LONG_RUN)
        d_stats = stats(served, D0)
        assert d_stats["num_preemptions_total"] > 0, d_stats
        assert stats(served, P0)["handoffs_with_kv_total"] == len(LONG)
        wait_for(lambda: stats(served, D0)["kv_cache_usage_perc"] == 0, 30, "d0's blocks free")
        assert all(stats(served, D0)[k] == 0 for k in (
            "num_requests_running", "num_requests_reserved", "num_reservations_waiting",
            "kv_blocks_held"))
    finally:
        assert served.stop() == 0, served.log_tail()


def test_pd_tp2_on_both_sides(tiny, expected, tmp_path):
    served, model = start_pd(tiny, tmp_path, "--tp", "2")
    try:
        got = all_concurrently(served, model, LONG[:2])
        assert got == first(expected, LONG[:2])
        p_stats = wait_for(lambda: (s := stats(served, P0)).get("handoffs_total") == 2 and s,
                           30, "prefill stats")
        # both went with their K/V (a follower's first heartbeat, written while it loaded,
        # had no KV descriptor: read then, it kept d0 refusing every reservation for good)
        assert p_stats["handoffs_with_kv_total"] == 2, p_stats
        assert p_stats["kv_transfer_failures_total"] == 0
        assert stats(served, D0)["handoffs_recomputed_total"] == 0
    finally:
        assert served.stop() == 0, served.log_tail()


def _kill_when(served, keys: Keys, predicate, what: str) -> None:
    pid = worker_pid(served, keys)
    wait_for(predicate, 60, what)
    os.kill(pid, signal.SIGKILL)


def test_pd_failures_lose_and_repeat_nothing(tiny, expected, tmp_path):
    """A prefill worker killed while it sends, a decode worker killed mid-stream, then the
    decode scheduler killed mid-stream: every stream still ends with transformers' tokens."""
    served, model = start_pd(tiny, tmp_path)
    try:
        prompts = LONG
        with ThreadPoolExecutor(1) as pool:
            # the prefill worker dies while it computes and sends a prompt's chunks
            running = pool.submit(all_concurrently, served, model, prompts, LONG_RUN)
            _kill_when(served, P0, lambda: stats(served, P0).get("kv_transfer_bytes_total", 0) > 0,
                       "a KV send started")
            assert running.result(timeout=240) == first(expected, prompts, LONG_RUN)
            # the decode worker dies while it streams
            running = pool.submit(all_concurrently, served, model, prompts, LONG_RUN)
            before = stats(served, D0).get("handoffs_total", 0)
            _kill_when(served, D0,
                       lambda: stats(served, D0).get("handoffs_total", 0) > before,
                       "a request handed over")
            assert running.result(timeout=240) == first(expected, prompts, LONG_RUN)
            # the decode scheduler dies while it streams: restarted under the same name, it
            # takes back the requests handed to it from their progress records
            running = pool.submit(all_concurrently, served, model, prompts, LONG_RUN)
            before = stats(served, D0).get("handoffs_total", 0)
            wait_for(lambda: stats(served, D0).get("handoffs_total", 0) > before, 60,
                     "a request handed over")
            pid = scheduler_pid(served, "d0")
            os.kill(pid, signal.SIGKILL)
            assert running.result(timeout=240) == first(expected, prompts, LONG_RUN)
        with open(served.log_path, encoding="utf-8", errors="replace") as f:
            log = f.read()
        for child in ("p0 worker rank 0", "d0 worker rank 0", "d0 scheduler"):
            assert f"{child} exited (killed by SIGKILL)" in log, child
        # d0's first scheduler had no predecessor whose reservations a prefill worker could
        # still write into, and started at once; the one restarted after it waited
        untold = "no prefill worker was told where its pool is"
        killed = log.index("d0 scheduler exited (killed by SIGKILL)")
        assert log.count(untold) == 1 and log.index(untold) < killed
        assert "waiting for prefill workers' late K/V writes into this instance" in log[killed:]
    finally:
        assert served.stop() == 0, served.log_tail()


def scheduler_beat(served, instance: str) -> dict:
    """What an instance's scheduler heartbeat says."""
    from scheduler_svc.cli import default_scheduler_id
    r = redis.Redis.from_url(served.redis_url)
    try:
        return decode(r.get(Keys().hb_scheduler(default_scheduler_id(instance)))).extra
    finally:
        r.close()


def scheduler_pid(served, instance: str) -> int:
    return scheduler_beat(served, instance)["pid"]


@pytest.mark.parametrize("fault", ["late", "drop"])
def test_pd_transfer_that_never_completes_or_lies_is_recomputed(tiny, expected, tmp_path, fault):
    # late: the sends start 4 s after they were asked for, so they are given up at the 2 s
    # deadline and land later (the decode side keeps the blocks they target from every
    # request until the prefill worker's heartbeat no longer names them); drop: the
    # transport reports them done but wrote nothing, and only the decode side's check of
    # what arrived can tell
    served, model = start_pd(tiny, tmp_path, "--kv-timeout-s", "2",
                             env={"PACER_KV_FAULT": fault, "PACER_KV_LATE_S": "4"})
    held: list[float] = []
    done = threading.Event()

    def watch_held() -> None:
        while not done.is_set():
            held.append(stats(served, D0).get("kv_blocks_held", -1.0))
            time.sleep(0.1)
    watcher = threading.Thread(target=watch_held)
    watcher.start()
    try:
        got = all_concurrently(served, model, LONG[:2])
        assert got == first(expected, LONG[:2])
        failures = stats(served, P0)["kv_transfer_failures_total"]
        checks_failed = stats(served, D0)["kv_check_failures_total"]
        if fault == "late":
            assert failures >= 1 and checks_failed == 0
        else:
            assert failures == 0 and checks_failed == 2
        # back in the pool once nothing can land in them any more
        wait_for(lambda: stats(served, D0)["kv_blocks_held"] == 0, 30, "held blocks released")
        assert max(held) > 0, "the blocks of the given-up transfers were never held"
        assert all(stats(served, D0)[k] == 0 for k in ("num_requests_reserved",
                                                        "num_requests_running"))
        assert stats(served, D0)["handoffs_recomputed_total"] >= 1
    finally:
        done.set()
        watcher.join()
        assert served.stop() == 0, served.log_tail()


def test_pd_redis_lost_mid_transfer_holds_the_decode_blocks_until_the_write_lands(
        tiny, expected, tmp_path):
    """Redis killed (and restarted empty by `pacer up`) while the prefill worker writes a
    prompt's K/V, a write that starts 6 s late: the decode scheduler forgets the reservation
    but keeps its blocks from other requests until the prefill worker's heartbeat no longer
    names the write, then frees them; the streams after are exact. The blocks went back at
    once before, and the late write landed in whatever request had them next."""
    served, model = start_pd(tiny, tmp_path, "--kv-timeout-s", "1",
                             env={"PACER_KV_FAULT": "late", "PACER_KV_LATE_S": "6"})
    r = redis.Redis.from_url(served.redis_url)
    try:
        redis_pid = r.info("server")["process_id"]
        with ThreadPoolExecutor(1) as pool:
            lost = pool.submit(lambda: usage_of(served.base_url, model, LONG[2]))

            def writing() -> bool:
                beat = r.get(P0.hb_worker(0))
                return beat is not None and bool(decode(beat).extra.get("kv_unsettled"))
            wait_for(writing, 60, "the prefill worker writing a prompt's K/V")
            os.kill(redis_pid, signal.SIGKILL)
            with pytest.raises(OSError):
                lost.result(timeout=60)             # its stream ends with an error

        def held() -> float:
            try:
                return stats(served, D0).get("kv_blocks_held", 0)
            except redis.ConnectionError:       # still restarting
                return 0
        wait_for(lambda: held() > 0, 30, "the forgotten reservation's blocks held")
        wait_for(lambda: held() == 0, 60, "held blocks released once the write landed")
        assert all_concurrently(served, model, LONG[:2]) == first(expected, LONG[:2])
    finally:
        r.close()
        assert served.stop() == 0, served.log_tail()
