"""A plan the worker cannot carry out (a scheduler out of step with it: a request it does not
hold, a block outside its pool, rows its request does not have) is refused with one line that
names the plan, the request and the problem, before any state changes; not a KeyError from
deep inside the step, nor K/V written outside the pool."""
from __future__ import annotations

import asyncio

import msgpack
import pytest

from gpu_worker.model_runner import InvalidPlan, build_runner
from gpu_worker.service import PlanLoop
from shared.engine_args import EngineArgs
from shared.engine_layout import engine_layout
from shared.errors import PacerError
from shared.keys import Keys
from shared.lifecycle import connect_redis, redis_run_id, stream_tail_id
from shared.plan import CachedRequestData, IterationPlan, NewRequestData, StepResult
from shared.protocol import SCHEMA_VERSION, STREAM_FIELD, PlanMsg, to_fields
from shared.sampling import SamplingParams
from tests.helpers_tiny_model import write_tiny_llama
from tests.redis_fixture import redis_server  # noqa: F401  (the fixture)

BLOCK, BLOCKS = 16, 8
DEADLINE_S = 30.0
PROMPT = list(range(3, 23))         # 20 tokens: two blocks


def new(rid: str, block_table: list[int], tokens: list[int] = PROMPT) -> NewRequestData:
    return NewRequestData(rid, tokens, len(tokens), SamplingParams(temperature=0), block_table,
                          0)


# (what the plan does wrong, the plan's parts, what the error says)
BAD_PLANS = [
    ("continues a request it never sent", dict(cached=[CachedRequestData("zz", [], 3)],
                                               sched={"zz": 1}), "request zz is not running"),
    ("schedules a request it never sent", dict(sched={"zz": 1}),
     "request zz is scheduled but not running"),
    ("continues a request it drops", dict(cached=[CachedRequestData("a", [], 20)],
                                          sched={"a": 1}, finished=["a"]),
     "request a is not running"),
    ("sends a running request as new", dict(new=[new("a", [2, 3])], sched={"a": 20}),
     "request a is sent as new but is already running"),
    ("names a block past the pool", dict(new=[new("b", [2, BLOCKS])], sched={"b": 20}),
     "outside this worker's pool of 8"),
    ("names a negative block", dict(new=[new("b", [-1, 2])], sched={"b": 20}),
     "outside this worker's pool"),
    ("adds a block past the pool", dict(cached=[CachedRequestData("a", [99], 20)],
                                        sched={"a": 1}), "outside this worker's pool"),
    ("disagrees on the tokens computed", dict(cached=[CachedRequestData("a", [], 5)],
                                              sched={"a": 1}),
     "request a has 20 tokens computed here, the plan says 5"),
    ("gives more rows than there are tokens", dict(cached=[CachedRequestData("a", [], 20)],
                                                   sched={"a": 2}),
     "request a is given 2 rows from token 20, and has 21 tokens"),
    ("gives no rows", dict(new=[new("b", [2, 3])], sched={"b": 0}), "is given 0 rows"),
    ("gives rows past the block table", dict(new=[new("b", [2])], sched={"b": 20}),
     "request b is given 20 rows from token 0, and has 20 tokens in 1 blocks"),
]


def test_a_plan_that_does_not_fit_the_worker_is_refused_saying_why(tmp_path):
    """Each bad plan is refused; the request the worker holds is as it was, and decodes on
    to the tokens of a worker never sent them."""
    layout = engine_layout(EngineArgs(model=write_tiny_llama(tmp_path), dtype="float32",
                                      block_size=BLOCK, num_kv_blocks=BLOCKS, max_model_len=256))
    runner, undisturbed = (build_runner(layout, progress=False) for _ in range(2))
    prefill = IterationPlan(1, [new("a", [0, 1])], [], {"a": 20})
    runner.execute(prefill)
    state = runner.requests["a"]
    before = (list(state.token_ids), state.num_computed_tokens, list(state.block_table))
    for step, (what, parts, says) in enumerate(BAD_PLANS, start=2):
        plan = IterationPlan(step, parts.get("new", []), parts.get("cached", []),
                             parts["sched"], finished_request_ids=parts.get("finished", []))
        with pytest.raises(InvalidPlan, match=f"plan {step} cannot be carried out: .*{says}"):
            runner.execute(plan)
        assert list(runner.requests) == ["a"], what
        state = runner.requests["a"]
        assert (state.token_ids, state.num_computed_tokens, state.block_table) == before, what
    decode = IterationPlan(len(BAD_PLANS) + 2, [], [CachedRequestData("a", [], 20)], {"a": 1})
    undisturbed.execute(prefill)
    assert runner.execute(decode).sampled == undisturbed.execute(decode).sampled


# ---- a plan the worker cannot read --------------------------------------------------------

class Recording:
    """An executor that records the steps it ran."""

    def __init__(self) -> None:
        self.requests: dict = {}
        self.steps: list[int] = []

    def execute(self, plan: IterationPlan) -> StepResult:
        self.steps.append(plan.step)
        return StepResult(plan.step, {})


async def test_a_plan_sent_to_the_worker_that_it_cannot_read_stops_it_saying_why(
        redis_server):
    """A scheduler's plan the worker cannot decode (a scheduler of another version of pacer)
    stops rank 0 with one line saying so: skipped, its result never came and the scheduler
    waited for it forever. An entry no scheduler sent (no run_id) is skipped as before."""
    redis = await connect_redis(redis_server)
    keys = Keys("bad-plans:")
    try:
        run_id = await redis_run_id(redis)
        executor, stop = Recording(), asyncio.Event()
        loop = PlanLoop(redis, keys, executor, executor.requests,
                        await stream_tail_id(redis, keys.plans), run_id)
        running = asyncio.create_task(loop.run(stop))
        await redis.xadd(keys.plans, {STREAM_FIELD: b"not a plan"})
        plan = to_fields(PlanMsg(IterationPlan(1, [], [], {})), run_id=run_id)
        await redis.xadd(keys.plans, plan)
        newer = msgpack.unpackb(plan[STREAM_FIELD])
        newer["v"] += 1
        await redis.xadd(keys.plans, {**plan, STREAM_FIELD: msgpack.packb(newer)})
        with pytest.raises(PacerError, match="cannot read a plan the scheduler sent: "
                           f"message schema version {SCHEMA_VERSION + 1} is not supported.*same version"):
            await asyncio.wait_for(running, DEADLINE_S)
        assert executor.steps == [1]
    finally:
        stop.set()
        await redis.aclose()
