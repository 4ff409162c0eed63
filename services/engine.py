"""The in-process engine: the scheduling core and the model runner in one process.

Used by `pacer generate`, the tests and the benchmarks; the served system runs the same two
pieces in separate processes that talk through Redis.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from scheduler_svc.build import build_scheduler
from shared import gpu_memory
from shared.engine_args import EngineArgs
from shared.engine_layout import EngineLayout, engine_layout
from shared.outputs import RequestOutput
from shared.plan import PromptEntry, SampledToken
from shared.sampling import SamplingParams
from shared.tokenizer import load_tokenizer


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    tokens: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None              # finish_reason "error": why
    # position -> each prompt token's after the first, with SamplingParams.prompt_logprobs;
    # a recomputed prompt's repeats agree and are kept once
    prompt_logprobs: dict[int, PromptEntry] = field(default_factory=dict)

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


def _runner(layout: EngineLayout, progress: bool):
    """The model runner, or with tp > 1 a TPExecutor: this process is rank 0 and spawns
    ranks 1..tp-1. Imported here, not at the top: it loads torch, which the scheduler-only
    users of this module (benchmarks of the core) need not."""
    from gpu_worker.model_runner import build_runner, runner_config_for
    from gpu_worker.tp.spawn import launch_tp_executor

    if layout.args.device.startswith("cuda"):    # as `pacer up` checks before its workers
        gpu_memory.check_cuda_device(layout.args.device, layout.args.tp)
    if layout.args.tp == 1:
        return build_runner(layout, progress=progress)
    return launch_tp_executor(layout.model_config, layout.source,
                              runner_config_for(layout, progress), layout.args.tp)


class LLMEngine:
    """With `args.tp > 1` the runner is a TPExecutor over tp processes; call `shutdown()`
    (or use the engine as a context manager) to end them, else they end at exit."""

    def __init__(self, args: EngineArgs | EngineLayout, progress: bool = True, tokenizer=None):
        """`args` or the layout already derived from them (and its tokenizer, if loaded)."""
        layout = args if isinstance(args, EngineLayout) else engine_layout(args)
        self.args = layout.args
        self.layout = layout
        self.source = layout.source
        self.model_config = layout.model_config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(layout.source)
        self.max_model_len = layout.max_model_len
        self.scheduler_config = layout.scheduler_config
        self.runner = _runner(layout, progress)
        self.scheduler = build_scheduler(layout)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """End the tensor-parallel follower processes, and let go of the KV pool's
        registration with a transfer engine (P/D)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()
        getattr(self.runner, "runner", self.runner).close()

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
        outputs = self.scheduler.update(plan, result)
        if result.prompt_logprobs:
            by_id = {out.request_id: out for out in outputs}
            for rid, logprobs in result.prompt_logprobs.items():
                if rid not in by_id:
                    by_id[rid] = RequestOutput(rid)
                    outputs.append(by_id[rid])
                by_id[rid].prompt_logprobs = logprobs
        return outputs

    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams],
                 on_output=None) -> list[Completion]:
        """Run every prompt to completion; results in input order. `on_output(out, completion)`
        sees each step's delta after it is added to its request's Completion."""
        done = {}
        for i, (ids, sp) in enumerate(zip(prompts, sampling)):
            rid = self.add_request(ids, sp, request_id=str(i))
            done[rid] = Completion(rid, list(ids))
        while self.has_unfinished():
            for out in self.step():
                c = done[out.request_id]
                c.tokens.extend(out.new_tokens)
                if out.prompt_logprobs is not None:
                    for pos, entry in out.prompt_logprobs.by_position():
                        c.prompt_logprobs.setdefault(pos, entry)
                if out.finished:
                    c.finish_reason, c.error = out.finish_reason, out.error
                if on_output is not None:
                    on_output(out, c)
        return [done[str(i)] for i in range(len(prompts))]
