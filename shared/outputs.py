"""What the engine reports per request after each iteration."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.plan import PromptLogprobs, SampledToken


@dataclass(slots=True)    # one per request per iteration: slots make it cheaper to build
class RequestOutput:
    request_id: str
    new_tokens: list[SampledToken] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # prompt log-probabilities computed this iteration (SamplingParams.prompt_logprobs)
    prompt_logprobs: PromptLogprobs | None = None
    # of the prompt, the tokens found in the prefix cache when the request was first admitted
    # (set once it finished: the usage's cached tokens)
    num_cached_tokens: int = 0
    # finish_reason "error": why (the request's tokens ran out of choices: shared/plan.NO_TOKEN)
    error: str | None = None
