"""The in-process engine: the scheduling core and the model runner in one process.

Used by `pacer generate`, the tests and the benchmarks; the served system runs the same two
pieces in separate processes that talk through Redis.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from scheduler_svc.iteration_cost import latency_cost_for
from shared.config import (SchedulerConfig, kv_block_bytes, kv_cache_dtype,
                           num_blocks_for_memory)
from shared.engine_args import EngineArgs
from shared.errors import PacerError
from shared.model_config import check_tp_fits, ModelConfig, load_model_config
from shared.model_source import ModelSource, resolve_model
from shared.outputs import RequestOutput
from shared.plan import SampledToken
from shared.sampling import SamplingParams
from shared.tokenizer import load_tokenizer


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    tokens: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


# Bytes per element of each --dtype, so that the block count is known without importing torch
# (the scheduler service never loads it).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class EngineLayout:
    """Everything the scheduler and the workers must agree on, derived from EngineArgs and
    the model files by one function, so the two sides cannot disagree on the KV pool."""
    args: EngineArgs
    source: ModelSource
    model_config: ModelConfig
    max_model_len: int
    scheduler_config: SchedulerConfig

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler_config.num_kv_blocks


def engine_layout(args: EngineArgs) -> EngineLayout:
    """Resolve the model and size the KV pool: `--kv-cache-memory` is per rank, each rank
    holds `num_kv_heads / tp` heads of every block, in the KV cache's dtype (not always the
    weights')."""
    args = args.resolved()
    if args.dtype not in DTYPE_BYTES:
        raise PacerError(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {args.dtype!r}")
    source = resolve_model(args.model)
    cfg = load_model_config(source)
    check_tp_fits(cfg, args.tp)       # before anything is spawned or loaded
    num_blocks = args.num_kv_blocks or num_blocks_for_memory(
        args.kv_cache_memory,
        kv_block_bytes(cfg.num_layers, cfg.num_kv_heads // args.tp, cfg.head_dim,
                       args.block_size, DTYPE_BYTES[kv_cache_dtype(args.dtype, args.device)]))
    max_model_len = min(args.max_model_len or cfg.max_position_embeddings,
                        cfg.max_position_embeddings)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        num_kv_blocks=num_blocks, block_size=args.block_size,
        max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        max_iteration_ms=args.max_iteration_ms,
        iteration_cost=latency_cost_for(args.max_iteration_ms, args.hw, cfg, DTYPE_BYTES[args.dtype]))
    return EngineLayout(args, source, cfg, max_model_len, scheduler_config)


def build_scheduler(layout: EngineLayout):
    """The pure scheduling core for this layout."""
    from scheduler_svc.core import Scheduler
    return Scheduler(layout.scheduler_config, eos_token_ids=layout.model_config.eos_token_ids,
                     max_model_len=layout.max_model_len)


def build_runner(layout: EngineLayout, tp=None, progress: bool = True):
    """Load the weights (this rank's shard when `tp` is a TPGroup) and allocate the KV pool."""
    from gpu_worker.model_runner import ModelRunner
    from gpu_worker.parallel import SINGLE

    return ModelRunner(layout.model_config, layout.source, _runner_config(layout, progress),
                       tp or SINGLE)


def _runner_config(layout: EngineLayout, progress: bool):
    from gpu_worker.model_runner import RunnerConfig

    args = layout.args
    return RunnerConfig(num_kv_blocks=layout.num_kv_blocks, block_size=args.block_size,
                        dtype=args.dtype, device=args.device, seed=args.seed, progress=progress)


def _tp_executor(layout: EngineLayout, progress: bool):
    """tp > 1 in one command: this process is rank 0 and spawns ranks 1..tp-1."""
    from gpu_worker.distributed import launch_tp_executor

    return launch_tp_executor(layout.model_config, layout.source,
                              _runner_config(layout, progress), layout.args.tp)


class LLMEngine:
    """With `args.tp > 1` the runner is a TPExecutor over tp processes; call `shutdown()`
    (or use the engine as a context manager) to end them, else they end at exit."""

    def __init__(self, args: EngineArgs, progress: bool = True):
        layout = engine_layout(args)
        self.args = layout.args
        self.layout = layout
        self.source = layout.source
        self.model_config = layout.model_config
        self.tokenizer = load_tokenizer(layout.source)
        self.max_model_len = layout.max_model_len
        self.scheduler_config = layout.scheduler_config
        self.runner = (build_runner(layout, progress=progress) if args.tp == 1
                       else _tp_executor(layout, progress))
        self.scheduler = build_scheduler(layout)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """End the tensor-parallel follower processes (nothing to do at tp=1)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                    request_id: str | None = None) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.scheduler.add_request(request_id, list(prompt_token_ids), sampling)
        return request_id

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration: plan, forward + sample, update. Returns per-request deltas."""
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        return self.scheduler.update(plan, result)

    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams],
                 on_output=None) -> list[Completion]:
        """Run every prompt to completion; results in input order."""
        done = {}
        for i, (ids, sp) in enumerate(zip(prompts, sampling)):
            rid = self.add_request(ids, sp, request_id=str(i))
            done[rid] = Completion(rid, list(ids))
        while self.has_unfinished():
            for out in self.step():
                c = done[out.request_id]
                c.tokens.extend(out.new_tokens)
                if out.finished:
                    c.finish_reason = out.finish_reason
                if on_output is not None:
                    on_output(out)
        return [done[str(i)] for i in range(len(prompts))]
