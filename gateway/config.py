"""The gateway's start-up settings, built once and passed explicitly."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from gateway.tool_parsers import PARSERS
from shared.errors import PacerError
from shared.keys import DEFAULT_PREFIX

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_WAITING_REQUESTS = 256
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
# a streaming client that reads nothing for this long, with output waiting for it, is dropped
DEFAULT_STALLED_CLIENT_TIMEOUT_S = 60.0
# how the router picks an engine instance (gateway/router.py)
POLICIES = ("round-robin", "least-loaded", "prefix")


def new_gateway_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = DEFAULT_PREFIX
    model: str | None = None               # a model spec for shared.model_source.resolve_model
    served_model_name: str | None = None   # default: the model source's name
    max_model_len: int | None = None       # default: the model's context length
    api_key: str | None = None             # when set, /v1/* needs "Authorization: Bearer <key>"
    tp: int = 1                            # worker ranks whose heartbeats /health requires
    # P/D: (instance id, TP degree) of every engine instance; empty: the colocated engine
    instances: tuple[tuple[str, int], ...] = ()
    # data-parallel replicas (the instances above): round-robin, least-loaded or prefix;
    # None: every request goes to the shared request stream
    router: str | None = None
    # P/D: the prefill instances the router chooses among (requests stay on the shared
    # stream, naming the one chosen); empty: the router's instances are replicas
    route_prefill: tuple[str, ...] = ()
    gateway_id: str = field(default_factory=new_gateway_id)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # a request whose finish event arrived waits at most this long for missing token events
    finish_grace_s: float = 5.0
    # requests sent upstream that have seen neither a token nor their end; more get a 429
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    request_timeout_s: float | None = None   # a deadline for requests that bring none
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S   # on SIGTERM, for running ones
    stalled_client_timeout_s: float = DEFAULT_STALLED_CLIENT_TIMEOUT_S
    # the model's tool-call format (gateway/tool_parsers.py): serves tool_choice "auto"
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise PacerError(f"--port must be in [0, 65535], got {self.port}")
        if self.tp < 1:
            raise PacerError(f"--tp must be >= 1, got {self.tp}")
        if self.api_key is not None and not self.api_key.strip():
            raise PacerError("--api-key (or $PACER_API_KEY, its default) is empty: give a "
                             "key, or leave both out to serve without one")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise PacerError("--served-model-name is empty: give a name, or leave the flag out "
                             "to serve the model under its own")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise PacerError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_body_bytes < 1024:
            raise PacerError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_waiting_requests < 1:
            raise PacerError(f"--max-waiting-requests must be >= 1, "
                             f"got {self.max_waiting_requests}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise PacerError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        if self.shutdown_timeout_s < 0:
            raise PacerError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")
        if not self.stalled_client_timeout_s > 0:
            raise PacerError(f"--stalled-client-timeout must be > 0, got "
                             f"{self.stalled_client_timeout_s}")
        self._check_instances()
        if self.router is not None and not self.instances:
            raise PacerError("--router needs --instances (the replicas it routes between)")
        if self.route_prefill and (self.router is None or not set(self.route_prefill)
                                   <= {i for i, _ in self.instances}):
            raise PacerError("--route-prefill needs --router and names among --instances")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise PacerError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if not self.gateway_id or any(c in self.gateway_id for c in " :*?[]"):
            raise PacerError(f"gateway id {self.gateway_id!r} must be non-empty, "
                             "without spaces, ':' or glob characters")

    def _check_instances(self) -> None:
        """Each instance named once, with an ID and at least one worker rank: /health waits
        for the ranks given here, and a TP of 0 let it answer ok while the instance's worker
        was gone; a name given twice was routed to as two replicas."""
        seen = set()
        for inst, tp in self.instances:
            if not inst:
                raise PacerError(f"--instances: ':{tp}' has no ID (give ID:TP, as r0:1)")
            if tp < 1:
                raise PacerError(f"--instances: {inst}:{tp}: the TP degree must be >= 1")
            if inst in seen:
                raise PacerError(f"--instances: {inst} is named twice")
            seen.add(inst)
