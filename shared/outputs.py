"""What the engine reports per request after each iteration."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.plan import SampledToken


@dataclass
class RequestOutput:
    request_id: str
    new_tokens: list[SampledToken] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
