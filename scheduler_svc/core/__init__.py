"""The pure scheduling core: `Request`, `BlockManager`, `Scheduler`.

Stdlib + `shared` only — no torch, redis, asyncio or numpy (a test checks `sys.modules`), so
the same core runs under the Redis service, the in-process engine and a simulator, and its
tests run in microseconds from plain ints.

- `request.py`       one request's state (vLLM v1's single representation) and its stop rule
- `block_manager.py` paged KV block accounting: free queue, ref counts, block tables
- `policy.py`        FCFS ordering and the preemption victim, kept apart from the loop
- `ttft_goal.py`     a P/D prefill instance's TTFT goal: deadline order, iteration size, attainment
- `scheduler.py`     the iteration loop: continue running, preempt, admit, build the plan
"""
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.policy import FcfsPolicy
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.scheduler import Scheduler

__all__ = ["BlockManager", "FcfsPolicy", "Request", "RequestStatus", "Scheduler"]
