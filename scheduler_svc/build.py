"""The scheduling core sized by an engine layout (the scheduler service, the in-process
engine, the benchmarks)."""
from __future__ import annotations

from scheduler_svc.core import Scheduler
from shared.engine_layout import EngineLayout


def build_scheduler(layout: EngineLayout) -> Scheduler:
    """The pure scheduling core for this layout."""
    return Scheduler(layout.scheduler_config, eos_token_ids=layout.model_config.eos_token_ids,
                     max_model_len=layout.max_model_len)
