"""What every handler needs, built once at start-up and kept on the application."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.streams import TokenRouter
from gateway.tool_parsers import PARSERS, ToolParser
from gateway.upstream import Upstream
from shared.keys import Keys
from shared.tokenizer import Tokenizer


@dataclass
class GatewayState:
    config: GatewayConfig
    keys: Keys
    tokenizer: Tokenizer
    served_model_name: str
    max_model_len: int
    metrics: GatewayMetrics
    redis: aioredis.Redis | None = None        # set while the app runs (cleanup_ctx)
    upstream: Upstream | None = None
    router: TokenRouter | None = None
    draining: bool = False                     # SIGTERM: no new requests
    # the drain's time ran out: a request admitted before it that has not been sent upstream
    # yet is refused (503) rather than started with nothing left to end it
    cut_off: bool = False
    num_admitted: int = 0                      # admitted, not yet answered: what a drain waits for
    num_waiting: int = 0                       # sent upstream, no token or end seen yet
    body_bytes: int = 0                        # of the request bodies being read
    # when the model was loaded (the tokenizer, here): its `created` time in /v1/models
    started_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def served_max_model_len(self) -> int:
        """The context a request can have end to end: this gateway's --max-model-len, or the
        live schedulers' where theirs is shorter (read from their heartbeats). What
        /v1/models states, so that a client sizing its requests by it is not refused."""
        upstream = None if self.upstream is None else self.upstream.served_max_model_len
        return self.max_model_len if upstream is None else min(self.max_model_len, upstream)

    @property
    def tool_parser(self) -> ToolParser | None:
        """The model's tool-call format (--tool-call-parser), which serves tool_choice auto."""
        return PARSERS.get(self.config.tool_call_parser or "")


class WaitingSlot:
    """One place in the gateway's bounded queue, taken when a request is admitted (before
    any await, so a burst cannot overshoot the bound) and given back once, at the request's
    first token or end."""

    def __init__(self, state: GatewayState) -> None:
        self._state = state
        state.num_waiting += 1
        self._held = True

    def release(self) -> None:
        if self._held:
            self._state.num_waiting -= 1
            self._held = False


STATE = web.AppKey("state", GatewayState)
