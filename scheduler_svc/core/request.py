"""One request as the scheduler sees it, and the rule that says when it stops.

vLLM v1's single representation: a request has `num_tokens` (prompt + generated) and
`num_computed_tokens` (how many of them have K/V in the cache). An iteration advances it by
some rows; a decode is simply the case `num_tokens - num_computed_tokens == 1`. There is no
prefill or decode phase to track.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"          # back in the waiting queue, blocks freed, to recompute
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"      # no token could be sampled (shared/plan.NO_TOKEN)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason: "stop" | "length" | "abort" | "error", or None while
        unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False, slots=True)   # slots: the scheduler reads these fields every iteration
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_index: int                       # FCFS order: the scheduler's counter at arrival
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Append-only while the request holds KV; the BlockManager clears it when it frees.
    block_table: list[int] = field(default_factory=list)
    # Prefix caching (docs/design.md#prefix-caching): the chained hashes of the full blocks
    # of all_token_ids computed so far (kept across preemption: the tokens do not change),
    # and how many leading blocks of block_table are in the cache index or were offered to it.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    reply_to: str = ""                       # served mode: the gateway's token channel
    # P/D decode side: set when the K/V of the prompt arrived from a prefill instance, until
    # the workers have been told of the request (docs/design.md#pd-disaggregation)
    kv_received: list[str] | None = None
    # when the request arrived, in seconds of the scheduler's clock (the TTFT goal's start)
    arrival_s: float = 0.0
    # when a free place could first have taken it, by the same clock (None: not seen yet, or
    # it never waited for one): where the token-gap target's pace counts its goal from
    # (docs/design.md#the-prompts-pace)
    place_s: float | None = None
    # prompt tokens the prefix cache held at its first admission (None until admitted; a P/D
    # decode side takes the prefill side's): OpenAI's usage.prompt_tokens_details.cached_tokens
    num_cached_prompt_tokens: int | None = None
    # iterations in a row its prefill waited for short prompts placed before it (the
    # scheduler stops deferring it after a few: a long prompt is never held back for good)
    num_deferred: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Rows still to feed before the request can sample: a decode has exactly one."""
        # Spelled out rather than via num_tokens: read for every row of every iteration.
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens


def stop_status(request: Request, eos_token_ids: frozenset[int],
                max_model_len: int) -> RequestStatus | None:
    """Whether the token just appended ends the request, checked in a fixed order.

    A stop token beats max_tokens: a request whose last allowed token is EOS reports "stop".
    """
    sampling = request.sampling
    if sampling.stops_on(request.output_token_ids[-1], eos_token_ids):
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= sampling.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
