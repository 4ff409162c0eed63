"""A plan the worker cannot carry out (a scheduler out of step with it: a request it does not
hold, a block outside its pool, rows its request does not have) is refused with one line that
names the plan, the request and the problem, before any state changes; not a KeyError from
deep inside the step, nor K/V written outside the pool."""
from __future__ import annotations

import pytest

from gpu_worker.model_runner import InvalidPlan, build_runner
from shared.engine_args import EngineArgs
from shared.engine_layout import engine_layout
from shared.plan import CachedRequestData, IterationPlan, NewRequestData
from shared.sampling import SamplingParams
from tests.helpers_tiny_model import write_tiny_llama

BLOCK, BLOCKS = 16, 8
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

