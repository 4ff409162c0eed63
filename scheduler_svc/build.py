"""The scheduling core sized by an engine layout (the scheduler service, the in-process
engine, the benchmarks)."""
from __future__ import annotations

from dataclasses import replace

from scheduler_svc.core import Scheduler
from shared import clock
from shared.engine_layout import EngineLayout


def build_scheduler(layout: EngineLayout, role: str = "colocated") -> Scheduler:
    """The pure scheduling core for this layout; the TTFT goal is a P/D prefill instance's
    alone (docs/design.md#the-ttft-goal). Its clock is Redis's, which the gateway stamps
    arrivals with (shared/clock.py)."""
    config = layout.scheduler_config
    if role != "prefill":
        config = replace(config, target_ttft_ms=None, target_ttft_factor=None)
    return Scheduler(config, eos_token_ids=layout.model_config.eos_token_ids,
                     max_model_len=layout.max_model_len,
                     vocab_size=layout.model_config.vocab_size, clock=clock.now)
