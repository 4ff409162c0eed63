"""Round trips of every protocol message through msgpack, and refusal of what is not one."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.keys import Keys
from shared.plan import (CachedRequestData, IterationPlan, NewRequestData, SampledToken,
                         StepResult)
from shared.protocol import (FINISH_REASONS, SCHEMA_VERSION, STREAM_FIELD, AbortMsg, CancelMsg,
                             FinishEvent, HandoffMsg, Heartbeat, PlanMsg, ProtocolError,
                             RequestMsg, ReserveMsg, ReservedMsg, StepResultMsg, TokenBatch,
                             TokenEvent, decode, encode, from_fields, to_fields)
from shared.sampling import SamplingParams

ids = st.text(min_size=1, max_size=12)
token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
logprob = st.one_of(st.none(), st.floats(max_value=0.0, allow_nan=False, allow_infinity=False))
top_logprobs = st.one_of(st.none(), st.lists(st.tuples(st.integers(0, 2**31 - 1),
                                                       st.floats(max_value=0.0, allow_nan=False)),
                                             max_size=5))

sampling = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 100_000),
    temperature=st.floats(0.0, 5.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 1000),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    stop_token_ids=st.lists(st.integers(0, 100_000), max_size=4).map(tuple),
    ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)

request_msgs = st.builds(RequestMsg, request_id=ids, prompt_token_ids=token_ids,
                         sampling=sampling, reply_to=ids, gateway_id=ids,
                         arrival_time=finite, deadline=st.one_of(st.none(), finite))
abort_msgs = st.builds(AbortMsg, request_id=ids, reason=st.text(max_size=30))

new_requests = st.builds(NewRequestData, request_id=ids, token_ids=token_ids,
                         num_prompt_tokens=st.integers(0, 10_000), sampling=sampling,
                         block_table=st.lists(st.integers(0, 100_000), max_size=10),
                         num_computed_tokens=st.integers(0, 10_000), reply_to=st.text(max_size=20))
cached_requests = st.builds(CachedRequestData, request_id=ids,
                            new_block_ids=st.lists(st.integers(0, 100_000), max_size=3),
                            num_computed_tokens=st.integers(0, 100_000))
plans = st.builds(IterationPlan, step=st.integers(0, 2**40), new_requests=st.lists(new_requests, max_size=3),
                  cached_requests=st.lists(cached_requests, max_size=5),
                  num_scheduled_tokens=st.dictionaries(ids, st.integers(1, 512), max_size=8),
                  finished_request_ids=st.lists(ids, max_size=4),
                  preempted_request_ids=st.lists(ids, max_size=4))
plan_msgs = plans.map(PlanMsg)

sampled = st.builds(SampledToken, token_id=st.integers(0, 2**31 - 1), logprob=logprob,
                    top_logprobs=top_logprobs)
step_result_msgs = st.builds(StepResult, step=st.integers(0, 2**40),
                             sampled=st.dictionaries(ids, sampled, max_size=8),
                             wide_from_rows=st.none() | st.integers(1, 4096)).map(StepResultMsg)

token_events = st.builds(TokenEvent, request_id=ids, index=st.integers(0, 100_000),
                         token_id=st.integers(0, 2**31 - 1), logprob=logprob,
                         top_logprobs=top_logprobs)
token_batches = st.lists(token_events, max_size=10).map(TokenBatch)
finish_events = st.builds(FinishEvent, request_id=ids, finish_reason=st.sampled_from(FINISH_REASONS),
                          num_prompt_tokens=st.integers(0, 10**6), num_output_tokens=st.integers(0, 10**6),
                          error=st.one_of(st.none(), st.text(max_size=40)))
heartbeats = st.builds(Heartbeat, service=st.sampled_from(["scheduler", "worker", "gateway"]),
                       id=ids, time=finite,
                       extra=st.dictionaries(st.text(max_size=8),
                                             st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=8), finite),
                                             max_size=4))

any_message = st.one_of(request_msgs, abort_msgs, plan_msgs, step_result_msgs, token_batches,
                        finish_events, heartbeats)


@settings(max_examples=150, deadline=None)
@given(any_message)
def test_every_message_round_trips(msg) -> None:
    assert decode(encode(msg)) == msg


@settings(max_examples=30, deadline=None)
@given(plans)
def test_plan_keeps_the_row_order_of_the_flat_batch(plan: IterationPlan) -> None:
    back = decode(encode(PlanMsg(plan))).plan
    assert list(back.num_scheduled_tokens) == list(plan.num_scheduled_tokens)


def test_stream_fields_round_trip_with_bytes_keys_as_redis_returns_them() -> None:
    msg = AbortMsg("r1", "client disconnected")
    fields = {k.encode(): v for k, v in to_fields(msg).items()}
    assert from_fields(fields) == msg


def test_unknown_version_is_refused_with_a_clear_error() -> None:
    data = msgpack.packb({"v": SCHEMA_VERSION + 1, "kind": "abort", "request_id": "r", "reason": ""})
    with pytest.raises(ProtocolError, match="version"):
        decode(data)


def test_unknown_kind_is_refused() -> None:
    data = msgpack.packb({"v": SCHEMA_VERSION, "kind": "tensor", "data": b"x"})
    with pytest.raises(ProtocolError, match="unknown message kind 'tensor'"):
        decode(data)


@pytest.mark.parametrize("data", [b"\xc1", msgpack.packb([1, 2]),
                                  msgpack.packb({"v": SCHEMA_VERSION, "kind": "abort"}),
                                  msgpack.packb({"v": SCHEMA_VERSION, "kind": "abort",
                                                 "request_id": "r", "bogus": 1})])
def test_garbage_and_malformed_bodies_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


def test_invalid_sampling_in_a_request_is_a_protocol_error() -> None:
    msg = RequestMsg("r", [1], SamplingParams(), "ch", "gw", 0.0)
    obj = msgpack.unpackb(encode(msg))
    obj["sampling"]["top_p"] = 2.0
    with pytest.raises(ProtocolError, match="top_p"):
        decode(msgpack.packb(obj))


def test_finish_reason_is_checked() -> None:
    with pytest.raises(ProtocolError, match="finish_reason"):
        FinishEvent("r", "done", 1, 1)


def test_a_non_message_cannot_be_encoded() -> None:
    with pytest.raises(ProtocolError):
        encode(TokenEvent("r", 0, 1))


def test_keys_share_one_prefix() -> None:
    keys = Keys("t1:")
    names = [keys.requests, keys.aborts, keys.plans, keys.results, keys.stats,
             keys.tokens("gw"), keys.hb_scheduler("s"), keys.hb_worker(0), keys.hb_gateway("gw")]
    assert all(n.startswith("t1:") for n in names)
    assert len(set(names)) == len(names)
    assert Keys().requests == "pacer:requests"
    assert keys.hb_scheduler("s").startswith(keys.hb_scheduler_pattern.rstrip("*"))


@pytest.mark.parametrize("field, value, match", [
    ("deadline", "soon", "deadline must be a finite number"),
    ("arrival_time", float("nan"), "arrival_time must be a finite number"),
    ("reply_to", None, "reply_to must be a string"),
    ("request_id", 7, "request_id must be a string"),
    ("prompt_token_ids", ["a"], "prompt_token_ids must be a list of integers"),
    ("prompt_token_ids", [True], "prompt_token_ids must be a list of integers"),
    ("prompt_token_ids", "abc", "prompt_token_ids must be a list of integers")])
def test_a_request_written_by_hand_with_a_wrong_type_is_a_protocol_error(field, value,
                                                                          match) -> None:
    """The request stream takes entries from anyone with Redis access (redis-cli XADD), not
    only from a gateway: a field of the wrong type is refused where the scheduler decodes it,
    named, rather than crashing it later."""
    obj = msgpack.unpackb(encode(RequestMsg("r", [1], SamplingParams(), "ch", "gw", 0.0)))
    obj[field] = value
    with pytest.raises(ProtocolError, match=f"malformed request message: {match}"):
        decode(msgpack.packb(obj, strict_types=False))


@pytest.mark.parametrize("msg", [AbortMsg("r", "client disconnected"), CancelMsg("r", "aborted"),
                                 ReservedMsg("r", "d0", "s0", [1], [], 0.0)])
def test_a_request_id_that_is_not_a_string_is_a_protocol_error(msg) -> None:
    """Readers key their tables by it: an unhashable id written by hand crashed them."""
    obj = msgpack.unpackb(encode(msg))
    obj["request_id"] = [1, 2]
    with pytest.raises(ProtocolError, match=r"request_id must be a string, got \[1, 2\]"):
        decode(msgpack.packb(obj))


@pytest.mark.parametrize("carrier, field, value, match", [
    *((carrier, "request", value, match) for carrier in ("handoff", "reserve")
      for value, match in ((b"not msgpack", "not a msgpack message"),
                           (7, "request must be an encoded request message, got 7"),
                           ("abc", "request must be an encoded request message"))),
    ("handoff", "entry_id", 5, "entry_id must be a string"),
    ("handoff", "output_token_ids", ["a"], "output_token_ids must be a list of integers"),
    ("handoff", "kv_received", [1], "kv_received must be a list of strings"),
    ("reserve", "prefill_instance", None, "prefill_instance must be a string")])
def test_a_p_d_message_whose_request_is_not_one_is_a_protocol_error(carrier, field, value,
                                                                    match) -> None:
    """A hand-off or reservation ask carries its request encoded, and the decode scheduler
    decoded it only as it acted: one written by hand (or damaged) crashed it there. It is
    checked where the carrier is read, as the requests are, and the reader skips it."""
    request = encode(RequestMsg("r", [1], SamplingParams(), "ch", "gw", 0.0))
    msg = (HandoffMsg(request, "1-0", [5], ["s"]) if carrier == "handoff"
           else ReserveMsg(request, "p0"))
    obj = msgpack.unpackb(encode(msg))
    obj[field] = value
    data = msgpack.packb(obj, use_bin_type=True)
    with pytest.raises(ProtocolError, match=match):
        decode(data)
    from scheduler_svc.disagg import stream_messages
    assert list(stream_messages([("s", [("1-0", {STREAM_FIELD: data})])])) == [("1-0", None)]
