"""The in-process engine: the scheduling core and the model runner in one process.

Used by `pacer generate`, the tests and the benchmarks; the served system runs the same two
pieces in separate processes that talk through Redis.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shared.config import SchedulerConfig, num_blocks_for_memory
from shared.engine_args import EngineArgs
from shared.errors import PacerError
from shared.model_config import load_model_config
from shared.model_source import resolve_model
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


class LLMEngine:
    def __init__(self, args: EngineArgs, progress: bool = True):
        from gpu_worker.kv_cache import block_bytes
        from gpu_worker.model_runner import DTYPES, ModelRunner, RunnerConfig
        from scheduler_svc.core import Scheduler

        if args.tp != 1:
            raise PacerError("the in-process engine runs tp=1; use the TP launcher for --tp > 1")
        self.args = args
        self.source = resolve_model(args.model)
        self.model_config = cfg = load_model_config(self.source)
        self.tokenizer = load_tokenizer(self.source)
        num_blocks = args.num_kv_blocks or num_blocks_for_memory(
            args.kv_cache_memory, block_bytes(cfg, args.block_size, 1, DTYPES[args.dtype]))
        self.max_model_len = min(args.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            num_kv_blocks=num_blocks, block_size=args.block_size,
            max_model_len=self.max_model_len, enable_chunked_prefill=args.enable_chunked_prefill)
        self.runner = ModelRunner(cfg, self.source, RunnerConfig(
            num_kv_blocks=num_blocks, block_size=args.block_size, dtype=args.dtype,
            device=args.device, seed=args.seed, progress=progress))
        self.scheduler = Scheduler(self.scheduler_config, eos_token_ids=cfg.eos_token_ids,
                                   max_model_len=self.max_model_len)
        self._ids = itertools.count()

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
