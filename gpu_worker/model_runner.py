"""ModelRunner: applies a plan's diffs to its per-request state, runs one mixed varlen
forward, samples, and reports the sampled tokens.

The runner keeps each request's tokens itself (prompt + every token it sampled), so a plan
never carries token values: a decode's input is the last token this runner drew.

A new request may start past a cached prefix (docs/design.md#prefix-caching): its first
blocks hold K/V another request computed. The runner refuses one whose prefix blocks this
process never wrote — a restarted worker answering a plan made for the one before it —
rather than attend over a cache it does not have.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from gpu_worker.attention import Chunk, build_attention_metadata, select_backend
from gpu_worker.cpu_kernels import cpu_kernels
from gpu_worker.host_memory import keep_freed_memory
from gpu_worker.kv_cache import allocate_kv_cache
from gpu_worker.model.llama import LlamaForCausalLM
from gpu_worker.parallel import SINGLE, TPGroup
from gpu_worker.sampler import Sampler
from gpu_worker.weights import iter_weights
from shared.config import activation_dtype, kv_cache_dtype
from shared.model_config import ModelConfig
from shared.model_source import ModelSource
from shared.plan import IterationPlan, NewRequestData, StepResult
from shared.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    num_kv_blocks: int
    block_size: int
    dtype: str = "float32"
    device: str = "cpu"
    seed: int | None = None
    progress: bool = True


@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    reply_to: str = ""
    extra: dict = field(default_factory=dict)


class UnknownKVCache(RuntimeError):
    """A plan relies on K/V this process does not hold."""


class ModelRunner:
    def __init__(self, cfg: ModelConfig, source: ModelSource, rc: RunnerConfig,
                 tp: TPGroup = SINGLE):
        self.cfg, self.rc, self.tp = cfg, rc, tp
        self.dtype = DTYPES[rc.dtype]
        torch.manual_seed(0)
        if rc.device == "cpu":
            keep_freed_memory()
        with torch.device("cpu"):
            model = LlamaForCausalLM(cfg, tp)
        model.load_weights(iter_weights(source, cfg, progress=rc.progress and tp.rank == 0))
        # On CPU the residual stream, norms and attention math stay in float32 whatever the
        # weight dtype; the KV cache is stored in the weights' dtype (shared/config.py).
        self.act_dtype = DTYPES[activation_dtype(rc.dtype, rc.device)]
        self.model = model.to(device=rc.device).eval()
        fused = cpu_kernels() if rc.device == "cpu" and self.dtype != self.act_dtype else None
        self.model.set_dtypes(self.dtype, self.act_dtype, fused)
        self.backend = select_backend(rc.device)
        kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.kv_caches = allocate_kv_cache(cfg, rc.num_kv_blocks, rc.block_size, kv_heads,
                                           DTYPES[kv_cache_dtype(rc.dtype, rc.device)], rc.device)
        self.sampler = Sampler(rc.device, rc.seed)
        self.requests: dict[str, _RequestState] = {}
        self._written = bytearray(rc.num_kv_blocks)     # 1: this process wrote K/V there

    @torch.inference_mode()
    def execute(self, plan: IterationPlan) -> StepResult:
        self._apply(plan)
        if plan.is_empty:
            return StepResult(plan.step, {})
        input_ids, chunks, order = self._inputs(plan)
        meta = build_attention_metadata(chunks, self.rc.block_size, self.rc.device, self.act_dtype)
        logits = self.model(input_ids, self.kv_caches, meta, self.backend)
        sampling_ids = [rid for rid, c in zip(order, chunks) if c.samples]
        states = [self.requests[r] for r in sampling_ids]
        with record_function("sampling"):
            tokens = self.sampler.sample(logits, [s.sampling for s in states],
                                         [len(s.token_ids) - s.num_prompt_tokens for s in states])
        size, written = self.rc.block_size, self._written
        for rid, n in plan.num_scheduled_tokens.items():
            s = self.requests[rid]
            for index in range(s.num_computed_tokens // size,
                               (s.num_computed_tokens + n - 1) // size + 1):
                written[s.block_table[index]] = 1
            s.num_computed_tokens += n
        for s, t in zip(states, tokens):
            s.token_ids.append(t.token_id)
        return StepResult(plan.step, dict(zip(sampling_ids, tokens)))

    def _apply(self, plan: IterationPlan) -> None:
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            cached = new.block_table[:-(-new.num_computed_tokens // self.rc.block_size)]
            if not all(self._written[b] for b in cached):
                raise UnknownKVCache(
                    f"plan {plan.step}: request {new.request_id} starts after a cached prefix "
                    "in blocks this worker never wrote (it restarted); the scheduler must "
                    "recompute")
            self.requests[new.request_id] = _state_of(new)
        for cached in plan.cached_requests:
            s = self.requests[cached.request_id]
            s.block_table.extend(cached.new_block_ids)
            assert s.num_computed_tokens == cached.num_computed_tokens, cached.request_id

    def _inputs(self, plan: IterationPlan):
        ids: list[int] = []
        chunks: list[Chunk] = []
        order: list[str] = []
        for rid, n in plan.num_scheduled_tokens.items():
            s = self.requests[rid]
            start = s.num_computed_tokens
            ids.extend(s.token_ids[start:start + n])
            kv_len = start + n
            chunks.append(Chunk(n, kv_len, s.block_table, samples=kv_len == len(s.token_ids)))
            order.append(rid)
        return torch.tensor(ids, dtype=torch.int64, device=self.rc.device), chunks, order


def _state_of(new: NewRequestData) -> _RequestState:
    return _RequestState(list(new.token_ids), new.num_prompt_tokens, new.sampling,
                         list(new.block_table), new.num_computed_tokens, new.reply_to)
