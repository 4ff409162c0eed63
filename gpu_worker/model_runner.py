"""ModelRunner: applies a plan's diffs to its per-request state, runs one mixed varlen
forward, samples, and reports the sampled tokens.

The runner keeps each request's tokens itself (prompt + every token it sampled), so a plan
never carries token values: a decode's input is the last token this runner drew.

A new request may start past a cached prefix (docs/design.md#prefix-caching): its first
blocks hold K/V another request computed. The runner refuses one whose prefix blocks this
process never wrote — a restarted worker answering a plan made for the one before it —
rather than attend over a cache it does not have — unless a prefill instance wrote it
(P/D, `kv_received`) into this very process's pool.

P/D (docs/architecture.md#kv-transfer): with a KV connector (`kv_connector`), a plan's
`kv_sends` leave layer by layer during the forward and are waited for before the result goes
back (failures in `StepResult.kv_failed`, figures in `kv_stats`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from gpu_worker.attention import Chunk, build_attention_metadata, select_backend
from gpu_worker.attention.metadata import int64_tensor
from gpu_worker.cpu_kernels import cpu_kernels
from gpu_worker.cuda_graphs import CAPTURABLE_BACKENDS, DecodeGraphs, capture_sizes
from gpu_worker.host_memory import keep_freed_memory, move_to_huge_pages
from gpu_worker.kv_cache import allocate_kv_pool, block_digests, layer_views
from gpu_worker.kv_transfer import LayerSender, make_connector
from gpu_worker.model.layers import RotaryEmbedding
from gpu_worker.model.llama import LlamaForCausalLM
from gpu_worker.parallel import SINGLE, TPGroup
from gpu_worker.profiling import scope
from gpu_worker.quant import resolve_quantization
from gpu_worker.quant.linear import wide_from_rows
from gpu_worker.sampler import Sampler, TokenCounts
from gpu_worker.structured import Grammars, mask_rows
from gpu_worker.weights import iter_weights
from shared.attention_choice import choose_attention_here
from shared.config import activation_dtype, kv_cache_dtype
from shared.engine_layout import EngineLayout
from shared.errors import PacerError
from shared.lifecycle import Claim
from shared.model_config import ModelConfig
from shared.model_source import ModelSource, kv_identity
from shared.plan import (GRAMMAR_FAILED, IterationPlan, KVCheck, NewRequestData, PromptLogprobs,
                         SampledToken, StepResult)
from shared.sampling import SamplingParams, token_id_set

log = structlog.get_logger("worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# CPU, quantized weights: an iteration of at most this many rows runs on one torch thread
# fewer than the worker has, leaving a core to the scheduler, the gateway and Redis, which
# otherwise stall both of the forward's threads at every barrier whenever they run (2 cores,
# served single streams: 155 against 138 tok/s at 2 streams, 104 against 78 at one; from 4
# streams on the second thread wins: docs/benchmarks.md#one-thread-for-few-rows).
# PACER_FEW_ROWS=0 turns it off.
FEW_ROWS = int(os.environ.get("PACER_FEW_ROWS", "2"))


@dataclass(frozen=True)
class RunnerConfig:
    num_kv_blocks: int
    block_size: int
    dtype: str = "float32"
    device: str = "cpu"
    seed: int | None = None
    progress: bool = True
    attention_backend: str = "auto"      # resolved here when still auto (shared/attention_choice.py)
    profile_tokens: int = 0              # CUDA: rows of the memory-profiling forward (0: none)
    gpu_memory_utilization: float = 0.9
    # the pool's size came from --gpu-memory-utilization (False: --kv-cache-memory or
    # --num-kv-blocks said it; the profile then only logs, since the memory other processes
    # hold is no part of this one's share)
    kv_from_utilization: bool = True
    # P/D's KV transfer (gpu_worker/kv_transfer): "none" or "mooncake"; where its engine
    # listens, over which protocol and device; how long an iteration waits for its sends
    kv_connector: str = "none"
    kv_host: str = "127.0.0.1"
    kv_protocol: str = "tcp"
    kv_device: str = ""
    kv_timeout_s: float = 10.0
    kv_layer_streaming: bool = True      # False: every layer leaves after the forward (bench)
    quantization: str = "none"           # auto|none|int8|int4 (gpu_worker/quant)
    load_format: str = "auto"            # dummy: random weights, no checkpoint read
    cuda_graphs: bool = True             # CUDA: decodes replay captured graphs
    max_model_len: int = 0               # the longest context: RoPE tables, graphs (0: the model's)
    max_num_seqs: int = 256              # the graphs' largest batch


@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    reply_to: str = ""
    # its last token was a stop token (`SamplingParams.stops_on`): rows a plan made ahead gives
    # it are skipped, never computed nor streamed (docs/design.md#overlap)
    stopped: bool = False
    # what its penalties need, kept up to date between steps (requests with penalties only)
    token_counts: TokenCounts | None = None
    # its structured output's grammar matcher, past its output so far (gpu_worker/structured.py)
    matcher: Any = None
    # of its prompt, the tokens the prefix cache held when first scheduled (None: it came
    # back with tokens already made, recomputed or handed over), sent with its first token
    num_cached_tokens: int | None = None


@dataclass(frozen=True)
class _Span:
    """Rows of one request's prompt chunk whose logits give prompt log-probabilities."""
    request_id: str
    start: int                  # the position of its first row
    rows: range                 # in the flat batch
    targets: list[int]          # the token after each row
    top: int                    # top log-probabilities asked for


class UnknownKVCache(Exception):
    """A plan relies on K/V this process does not hold. Every rank of a TP group raises it
    at the same point, before any collective: not a RuntimeError, which the TP executors
    read as a peer's death and wait for it to show (10 s)."""


class InvalidPlan(PacerError):
    """A plan that does not fit what this runner holds (a request it does not hold, a block
    outside its pool, rows its request does not have): a scheduler out of step with this
    worker. Raised before any state changes, by every rank of a TP group at the same point
    and before any collective, so the worker stops with this one line (and is restarted, its
    requests recomputed) instead of a KeyError from deep inside the step, or a GPU kernel
    writing K/V outside the pool."""


class ModelRunner:
    def __init__(self, cfg: ModelConfig, source: ModelSource, rc: RunnerConfig,
                 tp: TPGroup = SINGLE):
        self.cfg, self.rc, self.tp = cfg, rc, tp
        self.dtype = DTYPES[rc.dtype]
        torch.manual_seed(0)
        if rc.device == "cpu":
            keep_freed_memory()
        # CPU: built in float32 then cast (the parity tests' bits). Elsewhere the parameters are
        # created on the device in their final dtype and each checkpoint tensor is copied
        # straight into its shard, so the host never holds a float32 model (unverified on a
        # GPU).
        on_host = rc.device == "cpu"
        self.quantization = resolve_quantization(rc.quantization, source, cfg, tp.size, rc.device)
        quant = None if self.quantization == "none" else self.quantization
        self.wide_from_rows = wide_from_rows(self.quantization)     # with each result
        # RoPE tables for the positions this engine serves (its max_model_len, not the
        # config's context, which may be a million), and the CUDA memory profile's rows
        positions = max(rc.max_model_len or cfg.max_position_embeddings,
                        rc.profile_tokens if rc.device.startswith("cuda") else 0)
        with torch.device("cpu" if on_host else rc.device), \
                (contextlib.nullcontext() if on_host else _default_dtype(self.dtype)):
            model = LlamaForCausalLM(cfg, tp, quant, positions)
        if not on_host:     # RoPE tables computed on the host, as on CPU (same bits), then moved
            model.rotary = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta,
                                           cfg.rope_scaling)
        if rc.load_format == "dummy":
            if quant is not None:
                raise PacerError("--load-format dummy makes float weights: pass --quantization none")
            model.init_random()
        else:
            model.load_weights(iter_weights(source, cfg, progress=rc.progress and tp.rank == 0,
                                            quantized=quant is not None))
        # On CPU the residual stream, norms and attention math stay in float32 whatever the
        # weight dtype; the KV cache is stored in the weights' dtype (shared/config.py).
        self.act_dtype = DTYPES[activation_dtype(rc.dtype, rc.device)]
        self.model = model.to(device=rc.device).eval()
        # the fused ops serve wherever the GEMMs read bfloat16: bfloat16 weights, and quantized
        # ones whatever --dtype says (their kernels take bfloat16 activations)
        narrow = self.dtype != self.act_dtype or quant is not None
        fused = cpu_kernels() if rc.device == "cpu" and narrow else None
        self.model.set_dtypes(self.dtype, self.act_dtype, fused)
        if rc.device == "cpu":
            move_to_huge_pages(self.model)
        choice = choose_attention_here(rc.attention_backend, rc.device, rc.dtype, rc.block_size)
        if choice.block_size != rc.block_size:
            raise PacerError(f"block size {rc.block_size} is not the {choice.backend} backend's "
                             f"({choice.block_size})")
        self.backend = select_backend(choice.backend, rc.device, rc.block_size)
        if tp.rank == 0:
            log.info("attention backend", backend=choice.backend, block_size=rc.block_size,
                     reason=choice.reason, device=rc.device, dtype=rc.dtype,
                     quantization=self.quantization)
        kv_heads = self.model.layers[0].self_attn.num_kv_heads
        graphs = (rc.cuda_graphs and rc.device.startswith("cuda") and tp.size == 1
                  and choice.backend in CAPTURABLE_BACKENDS and rc.kv_connector == "none")
        # with graphs, one block more than the scheduler knows: where padding rows write
        kv_dtype = DTYPES[kv_cache_dtype(rc.dtype, rc.device, self.quantization)]
        self.kv_pool = allocate_kv_pool(cfg, rc.num_kv_blocks + graphs, rc.block_size, kv_heads,
                                        kv_dtype, rc.device)
        self.kv_caches = layer_views(self.kv_pool)
        self.graphs = None
        if graphs:
            longest = rc.max_model_len or cfg.max_position_embeddings
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, rc.block_size,
                                       -(-longest // rc.block_size), rc.num_kv_blocks,
                                       rc.device, capture_sizes(rc.max_num_seqs))
        elif rc.device.startswith("cuda") and tp.rank == 0:
            log.info("cuda graphs off", asked=rc.cuda_graphs, tp=tp.size, backend=choice.backend,
                     kv_connector=rc.kv_connector)
        self.kv_connector = make_connector(rc.kv_connector, rc.kv_host, rc.kv_protocol,
                                           rc.kv_device, tp.size, tp.rank)
        if self.kv_connector is not None:
            self.kv_connector.register(self.kv_pool, kv_identity(
                source, rc.dtype, self.quantization, rc.load_format == "dummy"))
        self.sampler = Sampler(rc.seed)
        self.grammars = Grammars(source, cfg.vocab_size, token_id_set(cfg.eos_token_ids))
        # called on the forward thread as an iteration's layers start (its inputs, metadata
        # and embedding done): the worker's plan loop holds its own Python work back until
        # then (gpu_worker/service.py PlanLoop.handed_over)
        self.on_forward: Callable[[], None] | None = None
        self.eos_token_ids = token_id_set(cfg.eos_token_ids)
        self._last_step: int | None = None      # the last plan run here
        self.requests: dict[str, _RequestState] = {}
        self._written = bytearray(rc.num_kv_blocks)     # 1: this process wrote K/V there
        # torch threads for many rows and for few (FEW_ROWS), set on the forward thread
        self._threads = torch.get_num_threads()
        self._few_rows_threads = max(1, self._threads - 1) \
            if rc.device == "cpu" and self.quantization != "none" else self._threads
        if rc.device.startswith("cuda") and rc.profile_tokens:
            self.profile_memory(rc.profile_tokens)

    @torch.inference_mode()
    def profile_memory(self, tokens: int) -> dict:
        """CUDA: one forward of `tokens` prompt rows (as many as the pool holds) over the
        allocated pool; log the peak beside what --gpu-memory-utilization allows, and fail,
        naming a block count that fits, when the layout's estimate was too generous
        (shared/gpu_memory.py). Unverified on a GPU."""
        bs = self.rc.block_size
        tokens = max(1, min(tokens, self.rc.num_kv_blocks * bs))
        torch.cuda.synchronize(self.rc.device)
        torch.cuda.reset_peak_memory_stats(self.rc.device)
        n_blocks = -(-tokens // bs)
        meta = build_attention_metadata([Chunk(tokens, tokens, list(range(n_blocks)))], bs,
                                        self.rc.device, self.act_dtype)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.rc.device)
        self.model(ids, self.kv_caches, meta, self.backend)
        torch.cuda.synchronize(self.rc.device)
        peak = torch.cuda.max_memory_reserved(self.rc.device)
        free, total = torch.cuda.mem_get_info(self.rc.device)
        allowed = int(total * self.rc.gpu_memory_utilization)
        used_by_others = total - free - torch.cuda.memory_reserved(self.rc.device)
        figures = {"peak_reserved": peak, "total": total, "allowed": allowed,
                   "outside_torch": used_by_others, "profile_tokens": tokens}
        log.info("gpu memory after a profiled forward", **figures)
        if self.rc.kv_from_utilization and peak + used_by_others > allowed:
            pool = sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)
            per_block = pool // self.rc.num_kv_blocks
            fits = self.rc.num_kv_blocks - -(-(peak + used_by_others - allowed) // per_block)
            raise PacerError(f"the KV pool of {self.rc.num_kv_blocks} blocks and a forward of "
                             f"{tokens} rows need {(peak + used_by_others) / 2**30:.1f} GiB, over "
                             f"--gpu-memory-utilization's {allowed / 2**30:.1f} GiB: pass "
                             f"--num-kv-blocks {max(fits, 0)} (or lower "
                             f"--max-num-batched-tokens)")
        return figures

    def close(self) -> None:
        """Unregister the KV pool from the transfer engine (idempotent): a peer's write that
        comes later fails there rather than landing in memory freed after this runner."""
        if self.kv_connector is not None:
            self.kv_connector.close()

    def fence_kv(self, claim: Claim) -> None:
        """P/D: this rank's K/V writes go only while its `claim` (shared/lifecycle.py) cannot
        have lapsed (gpu_worker/kv_transfer/connector.py)."""
        if self.kv_connector is not None:
            self.kv_connector.fence(claim)

    def kv_descriptor(self) -> dict | None:
        """This rank's registered pool, for the worker heartbeat (shared/kv_layout.py); None
        without a KV connector."""
        return self.kv_connector.descriptor() if self.kv_connector is not None else None

    def kv_progress(self) -> dict:
        """For the worker heartbeat (P/D, docs/failure-modes.md): `kv_unsettled`, request ->
        the decode sessions of the K/V writes this rank gave up at their deadline and that may
        still land (a decode instance holds the blocks they target until no beat names
        them), and `kv_writing_to`, the sessions any write may still land in (a restarted
        decode scheduler waits until its own are gone)."""
        if self.kv_connector is None:
            return {}
        unsettled = self.kv_connector.unsettled()       # polls: first
        peers = self.kv_connector.peers_written()
        return {**({"kv_unsettled": unsettled} if unsettled else {}),
                **({"kv_writing_to": peers} if peers else {})}

    @torch.inference_mode()
    def execute(self, plan: IterationPlan) -> StepResult:
        started = time.perf_counter()
        if plan.after_step is not None and plan.after_step != self._last_step:
            return self._skip(plan)
        self._last_step = plan.step
        self._check(plan)
        sender = self._kv_sender(plan)      # refuses a bad send before any state changes
        verified = [c.request_id for c in plan.kv_checks if self._kv_intact(c)]
        self._apply(plan)
        scheduled = self._scheduled(plan)
        if not scheduled:
            return self._with_kv(StepResult(plan.step, {}, kv_verified=verified), sender)
        input_ids, chunks, order, spans = self._inputs(scheduled)
        sampling_ids = [rid for rid, c in zip(order, chunks) if c.samples]
        states = [self.requests[r] for r in sampling_ids]
        with self._threads_for(len(input_ids)):
            logits = self._logits(input_ids, chunks, sender,
                                  [row for span in spans for row in span.rows])
            prompt_logprobs = {}
            if spans:
                logits, extra = logits[:len(states)], logits[len(states):]
                prompt_logprobs = self._prompt_logprobs(extra, spans)
            with scope("sampling"):
                constrained = [i for i, s in enumerate(states) if s.matcher is not None]
                if constrained:
                    mask_rows(logits, constrained, [states[i].matcher for i in constrained],
                              self.grammars.n_vocab)
                tokens = self.sampler.sample(
                    logits, [s.sampling for s in states],
                    [len(s.token_ids) - s.num_prompt_tokens for s in states],
                    [s.token_counts for s in states], self.eos_token_ids,
                    masked=bool(constrained))
        size, written = self.rc.block_size, self._written
        for rid, n in scheduled.items():
            s = self.requests[rid]
            for index in range(s.num_computed_tokens // size,
                               (s.num_computed_tokens + n - 1) // size + 1):
                written[s.block_table[index]] = 1
            s.num_computed_tokens += n
        eos = self.eos_token_ids
        for i, (rid, s, t) in enumerate(zip(sampling_ids, states, tokens)):
            # a matcher the grammar engine gave up on (at its construction, its mask or this
            # token) still takes EOS: its error, not the token, says the row has none
            if t.token_id >= 0 and s.matcher is not None and (
                    not s.matcher.consume_token(t.token_id) or s.matcher.is_error()):
                log.warning("the grammar engine gave up on a request's structured output; it "
                            "ends with an error", request_id=rid, error=s.matcher.get_error())
                t = tokens[i] = SampledToken(GRAMMAR_FAILED)
            if t.token_id < 0:       # no token (NO_TOKEN, GRAMMAR_FAILED): the scheduler ends it
                s.stopped = True
                continue
            s.token_ids.append(t.token_id)
            if s.sampling.stops_on(t.token_id, eos):
                s.stopped = True
        # forward_ms (the cost model's input) is the compute; the wait for the sends is
        # kv_stats["exposed_ms"]
        return self._with_kv(StepResult(plan.step, dict(zip(sampling_ids, tokens)),
                                        forward_ms=(time.perf_counter() - started) * 1e3,
                                        wide_from_rows=self.wide_from_rows,
                                        prompt_logprobs=prompt_logprobs, kv_verified=verified),
                             sender)

    def _prompt_logprobs(self, logits: torch.Tensor,
                         spans: list[_Span]) -> dict[str, PromptLogprobs]:
        """Row r's logits predict the token after it: its log-probability, its rank and the
        top ones."""
        # three passes over [rows, vocab] (python bench/scoring.py; 512 rows of 49,152 on 2
        # CPU cores: the log-softmax 33 ms, the rank 39 ms counted in int32, 72 in int64, the
        # top 5 16 ms; torch.logsumexp alone took 50)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor([t for span in spans for t in span.targets],
                               device=logprobs.device)
        picked = logprobs.gather(1, targets[:, None])
        ranks = ((logprobs > picked).sum(dim=-1, dtype=torch.int32) + 1).tolist()
        chosen = picked[:, 0].tolist()
        k = max(span.top for span in spans)
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0],) * 2
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        out, at = {}, 0
        for span in spans:
            n = len(span.targets)
            tops = [list(zip(ids[:span.top], lps[:span.top]))
                    for ids, lps in zip(top_ids[at:at + n], top_lp[at:at + n])]
            out[span.request_id] = PromptLogprobs(span.start + 1, chosen[at:at + n],
                                                  ranks[at:at + n], tops if span.top else None)
            at += n
        return out

    def _logits(self, input_ids: torch.Tensor, chunks: list[Chunk],
                sender: LayerSender | None, extra_rows: list[int] = ()) -> torch.Tensor:
        """The forward: the sampling rows' logits, then `extra_rows`'. `input_ids` on the
        host (a graph's inputs go to the GPU in one copy with the rest of its rows)."""
        size = self.graphs.size_for(chunks) if self.graphs is not None and not extra_rows \
            else None
        if size is not None:
            if self.on_forward is not None:
                self.on_forward()
            logits = self.graphs.run(input_ids, chunks, size)
            if not all(c.samples for c in chunks):
                logits = logits[[i for i, c in enumerate(chunks) if c.samples]]
            return logits
        meta = build_attention_metadata(chunks, self.rc.block_size, self.rc.device,
                                        self.act_dtype)
        if extra_rows:
            meta.sample_rows = torch.cat([meta.sample_rows, torch.tensor(
                extra_rows, dtype=meta.sample_rows.dtype, device=meta.sample_rows.device)])
        streaming = sender is not None and self.rc.kv_layer_streaming
        return self.model(input_ids.to(self.rc.device), self.kv_caches, meta, self.backend,
                          after_layer=sender.after_layer if streaming else None,
                          before_layers=self.on_forward)

    @contextlib.contextmanager
    def _threads_for(self, rows: int):
        """One torch thread fewer for an iteration of at most FEW_ROWS rows; the count
        the worker was given again after it."""
        if rows > FEW_ROWS or self._few_rows_threads == self._threads:
            yield
            return
        torch.set_num_threads(self._few_rows_threads)
        try:
            yield
        finally:
            torch.set_num_threads(self._threads)

    def _skip(self, plan: IterationPlan) -> StepResult:
        """A plan made ahead of one this process never ran (it was lost, or went to a worker
        before this one): its rows assume state this process lacks. Only what it drops is
        forgotten; the scheduler, missing the lost plan's result, recomputes
        (docs/design.md#overlap)."""
        if self.tp.rank == 0:
            log.warning("plan made ahead of a plan not run here; skipped", step=plan.step,
                        after_step=plan.after_step, last_step=self._last_step)
        for rid in plan.dropped_request_ids:
            self.requests.pop(rid, None)
        return StepResult(plan.step, {})

    def _kv_sender(self, plan: IterationPlan) -> LayerSender | None:
        if not plan.kv_sends:
            return None
        if self.kv_connector is None:
            raise PacerError(f"plan {plan.step} sends K/V of "
                             f"{[s.request_id for s in plan.kv_sends]} but this worker has no KV "
                             "connector: start it with --kv-connector mooncake")
        return LayerSender(self.kv_connector, plan.kv_sends, self.tp.rank,
                           self.rc.kv_timeout_s, self.kv_pool)

    @staticmethod
    def _with_kv(result: StepResult, sender: LayerSender | None) -> StepResult:
        """Wait for the iteration's sends (they must end before its result goes out); the
        digests of what they sent, as this rank's."""
        if sender is None:
            return result
        failed, digests, stats = sender.finish()
        if failed:
            log.warning("kv sends failed or timed out", step=result.step, requests=failed)
        return dataclasses.replace(result, kv_failed=failed, kv_stats=stats,
                                   kv_digests={rid: [d] for rid, d in digests.items()})

    def _kv_intact(self, check: KVCheck) -> bool:
        """P/D: whether the received blocks hold what the prefill side sent into them
        (docs/design.md#kv-integrity)."""
        rank, blocks = self.tp.rank, check.block_ids
        want = check.digests[rank] if rank < len(check.digests) else None
        got = block_digests(self.kv_pool, blocks) if want is not None and \
            len(want) == len(blocks) and all(0 <= b < self.kv_pool.shape[2] for b in blocks) \
            else None
        ok = got is not None and got == want
        if ok:
            # they hold what was sent, in this process's pool: the scheduler caches them once
            # every rank says so, and may plan them for another prompt before their request
            for b in blocks:
                self._written[b] = 1
        else:
            # which of the prompt's blocks differ (by position): where to look for the cause
            log.warning("received K/V differs from what was sent; it will be recomputed",
                        request_id=check.request_id, rank=rank, blocks=len(blocks),
                        differing=None if got is None else
                        [i for i, (g, w) in enumerate(zip(got, want)) if g != w])
        return ok

    def _check(self, plan: IterationPlan) -> None:
        """Raise InvalidPlan unless every request the plan continues is held here (and every
        new one is not), every block it names is in the pool, and each scheduled request has
        the rows it is given, within its block table. A request that stopped here is not
        looked at past being held: a plan made ahead may give it a row it never got the
        token for (`_scheduled` skips it)."""
        def refuse(why: str) -> None:
            raise InvalidPlan(f"plan {plan.step} cannot be carried out: {why}; the scheduler "
                              "is out of step with this worker")

        def check_blocks(rid: str, blocks: list[int]) -> None:
            if blocks and (min(blocks) < 0 or max(blocks) >= self.rc.num_kv_blocks):
                refuse(f"request {rid} names KV blocks outside this worker's pool of "
                       f"{self.rc.num_kv_blocks} ({min(blocks)}..{max(blocks)})")

        dropped = set(plan.dropped_request_ids) if plan.dropped_request_ids else ()
        held, new = self.requests, {r.request_id: r for r in plan.new_requests}
        for r in plan.new_requests:
            if r.request_id in held and r.request_id not in dropped:
                refuse(f"request {r.request_id} is sent as new but is already running here")
            check_blocks(r.request_id, r.block_table)
        added: dict[str, int] = {}
        for c in plan.cached_requests:
            s = held.get(c.request_id) if c.request_id not in dropped else None
            if s is None:
                refuse(f"request {c.request_id} is not running here")
            if c.num_computed_tokens != s.num_computed_tokens:
                refuse(f"request {c.request_id} has {s.num_computed_tokens} tokens computed "
                       f"here, the plan says {c.num_computed_tokens}")
            check_blocks(c.request_id, c.new_block_ids)
            added[c.request_id] = len(c.new_block_ids)
        for rid, n in plan.num_scheduled_tokens.items():
            r = new.get(rid)
            if r is not None:
                start, tokens, blocks = r.num_computed_tokens, len(r.token_ids), \
                    len(r.block_table)
            else:
                s = held.get(rid) if rid not in dropped else None
                if s is None:
                    refuse(f"request {rid} is scheduled but not running here")
                if s.stopped:
                    continue
                start, tokens, blocks = s.num_computed_tokens, len(s.token_ids), \
                    len(s.block_table) + added.get(rid, 0)
            if not 0 < n <= tokens - start or start + n > blocks * self.rc.block_size:
                refuse(f"request {rid} is given {n} rows from token {start}, and has "
                       f"{tokens} tokens in {blocks} blocks")

    def _apply(self, plan: IterationPlan) -> None:
        for rid in plan.dropped_request_ids:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            cached = new.block_table[:-(-new.num_computed_tokens // self.rc.block_size)]
            if new.kv_received:
                self._accept_received(plan.step, new, cached)
            elif not all(self._written[b] for b in cached):
                raise UnknownKVCache(
                    f"plan {plan.step}: request {new.request_id} starts after a cached prefix "
                    "in blocks this worker never wrote (it restarted); the scheduler must "
                    "recompute")
            state = self.requests[new.request_id] = _state_of(new)
            state.matcher = self.grammars.matcher(new.request_id, new.sampling,
                                                  state.token_ids[new.num_prompt_tokens:])
        for cached in plan.cached_requests:
            s = self.requests[cached.request_id]
            s.block_table.extend(cached.new_block_ids)

    def _accept_received(self, step: int, new: NewRequestData, cached: list[int]) -> None:
        """P/D: a prefill instance wrote the cached prefix into this rank's pool, through the
        session kv_received[rank]. Only this process's own session proves the pool it wrote
        into is this one (a restarted worker has another)."""
        rank = self.tp.rank
        theirs = new.kv_received[rank] if rank < len(new.kv_received) else None
        ours = self.kv_connector.descriptor()["session"] if self.kv_connector else None
        if ours is None or theirs != ours:
            raise UnknownKVCache(
                f"plan {step}: request {new.request_id}'s K/V was written to KV session "
                f"{theirs}, not this worker's ({ours}); the scheduler must recompute")
        for b in cached:
            self._written[b] = 1

    def _scheduled(self, plan: IterationPlan) -> dict[str, int]:
        """The plan's rows, less those of requests that already stopped here."""
        rows = plan.num_scheduled_tokens
        requests = self.requests
        if not any(requests[rid].stopped for rid in rows):
            return rows
        return {rid: n for rid, n in rows.items() if not requests[rid].stopped}

    def _inputs(self, scheduled: dict[str, int]):
        """The flat batch's ids (on the host), its chunks and their requests in order, and
        the rows whose logits give prompt log-probabilities: of a request that asked, each
        row of a prompt position but the last (whose logits sample the first output token)."""
        ids: list[int] = []
        chunks: list[Chunk] = []
        order: list[str] = []
        spans: list[_Span] = []
        for rid, n in scheduled.items():
            s = self.requests[rid]
            start = s.num_computed_tokens
            kv_len = start + n
            if s.sampling.prompt_logprobs is not None and start < s.num_prompt_tokens - 1:
                end = min(kv_len, s.num_prompt_tokens - 1)
                spans.append(_Span(rid, start, range(len(ids), len(ids) + end - start),
                                   s.token_ids[start + 1:end + 1], s.sampling.prompt_logprobs))
            ids.extend(s.token_ids[start:kv_len])
            if n > 1 and kv_len > s.num_prompt_tokens:     # a recompute past the prompt: rare
                recomputed = _recompute_chunks(s, start, kv_len)
                chunks += recomputed
                order += [rid] * len(recomputed)
            else:
                chunks.append(Chunk(n, kv_len, s.block_table, samples=kv_len == len(s.token_ids),
                                    prompt_row=n == 1 and kv_len <= s.num_prompt_tokens))
                order.append(rid)
        return int64_tensor(ids), chunks, order, spans


def _recompute_chunks(s: _RequestState, start: int, kv_len: int) -> list[Chunk]:
    """A chunk of several rows that reaches past the prompt: a recompute of decoded tokens
    (after a preemption or a failure). The rows at prompt positions stay one chunk, attended by
    the prompt kernel however the budget cut the prompt; each row past the prompt becomes a row
    of its own, attended as the decode it first was (docs/design.md#recovery-by-recompute), so
    that its K/V, and every token after it, have the bits an undisturbed run gives."""
    split = max(start, s.num_prompt_tokens)
    chunks = [Chunk(split - start, split, s.block_table, samples=False,
                    prompt_row=split - start == 1)] if split > start else []
    return chunks + [Chunk(1, p + 1, s.block_table, samples=p + 1 == len(s.token_ids))
                     for p in range(split, kv_len)]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _state_of(new: NewRequestData) -> _RequestState:
    tokens = list(new.token_ids)
    return _RequestState(tokens, new.num_prompt_tokens, new.sampling, list(new.block_table),
                         new.num_computed_tokens, new.reply_to,
                         token_counts=TokenCounts(tokens, new.num_prompt_tokens)
                         if new.sampling.adjusts_logits else None,
                         num_cached_tokens=new.num_cached_tokens
                         if len(tokens) == new.num_prompt_tokens else None)


def runner_config_for(layout: EngineLayout, progress: bool = True) -> RunnerConfig:
    args = layout.args
    return RunnerConfig(num_kv_blocks=layout.num_kv_blocks, block_size=args.block_size,
                        dtype=args.dtype, device=args.device, seed=args.seed, progress=progress,
                        attention_backend=args.attention_backend,
                        profile_tokens=args.max_num_batched_tokens,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_from_utilization=args.kv_cache_memory is None
                        and args.num_kv_blocks is None,
                        kv_connector=args.kv_connector, kv_host=args.kv_host,
                        kv_protocol=args.kv_protocol, kv_device=args.kv_device,
                        kv_timeout_s=args.kv_timeout_s, quantization=args.quantization,
                        load_format=args.load_format, cuda_graphs=args.cuda_graphs,
                        max_model_len=layout.max_model_len, max_num_seqs=args.max_num_seqs)


def build_runner(layout: EngineLayout, tp: TPGroup | None = None,
                 progress: bool = True) -> ModelRunner:
    """Load the weights (this rank's shard when `tp` is a TPGroup) and allocate the KV pool."""
    return ModelRunner(layout.model_config, layout.source, runner_config_for(layout, progress),
                       tp or SINGLE)
