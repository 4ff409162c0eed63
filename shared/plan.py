"""The iteration plan: what the scheduling core tells the workers to run, and what comes back.

One representation for every kind of work (docs/design.md#chunks): each scheduled request
advances by `num_scheduled_tokens[req_id]` rows from its `num_computed_tokens`. A decode is a
chunk of one row, a fresh prefill a chunk with an empty cached prefix, a later chunk one with
a cached prefix.

Full data travels the first time a request is scheduled (and again after a preemption, when
the request restarts with its generated tokens as part of the prompt); afterwards only diffs:
the blocks appended to its block table. The plan never carries the token sampled in the
previous iteration: the worker that sampled it appended it to its own copy of the request.

Which rows sample is derived, not sent: a request samples this iteration iff
`num_computed_tokens + num_scheduled_tokens == len(token_ids)` on the worker, i.e. the chunk
reaches the end of every token the request has.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from shared.sampling import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    token_ids: list[int]            # prompt + tokens generated before a preemption
    num_prompt_tokens: int          # how many of token_ids are the original prompt
    sampling: SamplingParams
    block_table: list[int]
    num_computed_tokens: int        # 0, or the tokens of a cached prefix in its first blocks
    reply_to: str = ""              # served mode: the pub/sub channel of the request's gateway
    # P/D (docs/design.md#pd-disaggregation): the K/V of the first num_computed_tokens came
    # from a prefill instance, written into this rank's pool through the KV connector whose
    # session is kv_received[rank]; a rank whose own session differs never got it (it
    # restarted) and must refuse the request
    kv_received: list[str] = field(default_factory=list)
    # of the prompt, what the prefix cache held at the request's first admission: the usage's
    # cached tokens, which the worker sends with the first token (num_computed_tokens is not
    # it after a preemption, when the request may find its own blocks cached)
    num_cached_tokens: int = 0


@dataclass(slots=True)    # not frozen: the core makes one per decode per iteration, and a
class CachedRequestData:  # frozen dataclass's __init__ costs ~3x (docs/benchmarks.md#cost-model-and-simulation)
    request_id: str
    new_block_ids: list[int]        # appended to the worker's block table
    num_computed_tokens: int        # before this iteration's chunk


@dataclass(frozen=True)
class KVSend:
    """P/D: send a request's K/V to the decode instance that reserved blocks for it. After the
    forward computed layer l, layer l's K and V of src_block_ids[i] (this instance's pool) go
    to dst_block_ids[i] of the peer's pool, rank r to rank r; peers[r] is the KV connector
    descriptor the peer's rank r published in its heartbeat."""
    request_id: str
    peer: str                       # the decode instance's id
    src_block_ids: list[int]
    dst_block_ids: list[int]
    peers: list[dict]


@dataclass(frozen=True)
class KVCheck:
    """P/D, the decode side: before activating a handed-over request, each rank compares a
    digest of the blocks its K/V were written into with the one the prefill side took of the
    blocks it sent (digests[rank][i] for block_ids[i]; docs/design.md#kv-integrity)."""
    request_id: str
    block_ids: list[int]
    digests: list[list[int]]


@dataclass(frozen=True)
class IterationPlan:
    step: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    # request id -> Q rows this iteration; dict order is the order of rows in the flat batch
    num_scheduled_tokens: dict[str, int]
    # requests the workers must forget before running this plan: finished or aborted
    finished_request_ids: list[str] = field(default_factory=list)
    # requests sent back to the waiting queue (preempted, or recomputed after a worker was
    # lost): the workers forget them too; they return later as new requests, recomputed
    preempted_request_ids: list[str] = field(default_factory=list)
    # P/D prefill instances: K/V leaving with this iteration, layer by layer
    kv_sends: list[KVSend] = field(default_factory=list)
    # P/D decode instances: received K/V to verify before this plan runs
    kv_checks: list[KVCheck] = field(default_factory=list)
    # a plan made ahead (docs/design.md#overlap): made on the assumption that plan
    # `after_step` ran just before it; workers that did not run that one (it was lost) skip
    # this plan, forgetting only its dropped ids. None: made with every result in
    after_step: int | None = None

    @property
    def dropped_request_ids(self) -> list[str]:
        """Every request the workers forget before running this plan."""
        return [*self.finished_request_ids, *self.preempted_request_ids]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


# SampledToken.token_id where every token of the row was masked (a grammar, allowed_token_ids,
# bad_words and min_tokens that leave nothing between them): no token, the request ends with
# an error (docs/design.md#structured-outputs)
NO_TOKEN = -1
# ... where the grammar engine gave up on the request's grammar (a regex such as
# (x{1000}){1000} passes every check and is past its limits at the first token; a schema
# {"$ref": "#"} allows no output at all): no token either, never one the grammar was not
# there to allow
GRAMMAR_FAILED = -2
# why, for each of them (a token id below zero is no token)
NO_TOKEN_ERRORS = {
    NO_TOKEN: "the request's constraints leave no token to generate (its structured output, "
              "allowed_token_ids, bad_words and min_tokens allow nothing together)",
    GRAMMAR_FAILED: "the grammar engine could not follow the request's structured output "
                    "(a grammar that allows no output, or one past the engine's limits); "
                    "simplify the constraint"}


@dataclass(frozen=True)
class SampledToken:
    """One sampled token of one request, with its log-probability and top alternatives."""
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class PromptEntry(NamedTuple):
    """One prompt token's log-probability given those before it, its rank among the
    vocabulary's (1: the most likely) and the top ones (None where none were asked for)."""
    logprob: float
    rank: int
    top: list[tuple[int, float]] | None


@dataclass(frozen=True)
class PromptLogprobs:
    """Prompt tokens' log-probabilities from one chunk of a request's prompt: entry k is the
    token at position `start + k`."""
    start: int
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def by_position(self) -> Iterator[tuple[int, PromptEntry]]:
        for k, (logprob, rank) in enumerate(zip(self.logprobs, self.ranks)):
            yield self.start + k, PromptEntry(
                logprob, rank, None if self.top_logprobs is None else self.top_logprobs[k])


@dataclass(frozen=True)
class StepResult:
    """What the workers send back for one plan: the token each sampling request drew."""
    step: int
    sampled: dict[str, SampledToken]
    forward_ms: float | None = None     # rank 0's measured time for the plan (cost model input)
    # rows from which the worker's GEMMs widen packed weights first (int4/int8 on CPU), a cost
    # per iteration the cost model prices (shared/online_cost.py); None: one GEMM path
    wide_from_rows: int | None = None
    # P/D: requests whose K/V sends did not complete (the decode side recomputes them), and
    # the sends' figures: bytes, ms spent sending, ms of it after the forward ended (exposed)
    kv_failed: list[str] = field(default_factory=list)
    kv_stats: dict | None = None
    # P/D: request id -> per rank, the digest of each source block this step sent (in the
    # order of its KVSend's blocks); and, on a decode instance, the kv_checks that passed on
    # every rank (one not listed, failed or never run, is recomputed)
    kv_digests: dict[str, list[list[int]]] = field(default_factory=dict)
    kv_verified: list[str] = field(default_factory=list)
    # the prompt log-probabilities this step computed (requests that asked), for the gateway:
    # rank 0 publishes them with the tokens; the scheduler never needs them
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
