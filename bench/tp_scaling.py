"""Tensor-parallel scaling: one iteration's time at tp=1 and tp=N on the same plans, and the
share of it rank 0 spends inside the forward's collectives (2 all-reduces per layer, 1 for
the embedding, 1 all-gather for the LM head) and in the control messages (plan broadcast,
token digest).

Two workloads: a decode batch (B requests, one token each, on a context of C tokens) and a
prefill chunk (one request, K prompt tokens, no sampling). The plans are built here, so both
runs execute exactly the same iterations.

    python bench/tp_scaling.py [--model smollm2-135m] [--tp 3] [--batch 16] [--context 128]
                               [--chunk 256] [--iters 8]

On a CPU the ranks share the cores (each gets cores/tp threads), so tp > 1 is expected to be
slower there; the figure that transfers to GPUs is the collectives' share.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import print_table, random_prompts  # noqa: E402  (before torch: OMP policy)
import torch  # noqa: E402
from gpu_worker.tp.spawn import launch_tp_executor  # noqa: E402
from gpu_worker.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from shared.model_config import load_model_config  # noqa: E402
from shared.model_source import resolve_model  # noqa: E402
from shared.plan import CachedRequestData, IterationPlan, NewRequestData  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

BLOCK = 16
GREEDY = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)


class Plans:
    """Builds the iteration plans of both workloads with a trivial block allocator."""

    def __init__(self, vocab: int):
        self.vocab, self.step, self.next_block = vocab, 0, 0

    def _plan(self, new=(), cached=(), sched=None, finished=()) -> IterationPlan:
        self.step += 1
        return IterationPlan(self.step, list(new), list(cached), dict(sched or {}), list(finished))

    def _blocks(self, tokens: int) -> list[int]:
        n = -(-tokens // BLOCK)
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def decode_setup(self, batch: int, context: int, iters: int) -> IterationPlan:
        """Prefill `batch` requests of `context` tokens, with blocks for `iters` more."""
        prompts = random_prompts(batch, context, context, self.vocab, seed=1)
        new = [NewRequestData(f"d{i}", p, len(p), GREEDY, self._blocks(context + iters + 1), 0)
               for i, p in enumerate(prompts)]
        return self._plan(new=new, sched={r.request_id: context for r in new})

    def decode(self, batch: int, computed: int) -> IterationPlan:
        ids = [f"d{i}" for i in range(batch)]
        return self._plan(cached=[CachedRequestData(r, [], computed) for r in ids],
                          sched={r: 1 for r in ids})

    def prefill_chunk(self, k: int, chunk: int, finished: list[str]) -> IterationPlan:
        """A fresh request of 2·chunk prompt tokens, of which this iteration runs `chunk`."""
        prompt = random_prompts(1, 2 * chunk, 2 * chunk, self.vocab, seed=100 + k)[0]
        new = NewRequestData(f"p{k}", prompt, len(prompt), GREEDY, self._blocks(2 * chunk), 0)
        return self._plan(new=[new], sched={new.request_id: chunk}, finished=finished)


def num_blocks(args) -> int:
    return args.batch * (-(-(args.context + args.iters + 1) // BLOCK)) + \
        (args.iters + 1) * (-(-2 * args.chunk // BLOCK))


def measure(runner, tp_group, cfg, args) -> dict[str, dict]:
    """Run the same plan sequence; per workload: median iteration time and rank 0's time in
    forward collectives and in control messages, each per iteration."""
    plans = Plans(cfg.vocab_size)
    runner.execute(plans.decode_setup(args.batch, args.context, args.iters))
    out = {}
    computed = args.context
    samples = []
    for i in range(args.iters + 1):          # the first is a warm-up
        samples.append(_timed(runner, tp_group, plans.decode(args.batch, computed)))
        computed += 1
    out[f"decode B={args.batch} ctx={args.context}"] = _summary(samples[1:])
    samples = []
    for k in range(args.iters + 1):
        finished = [f"p{k - 1}"] if k else ["d%d" % i for i in range(args.batch)]
        samples.append(_timed(runner, tp_group, plans.prefill_chunk(k, args.chunk, finished)))
    out[f"prefill chunk {args.chunk}"] = _summary(samples[1:])
    return out


def _timed(runner, tp_group, plan) -> tuple[float, float, float]:
    comm0 = tp_group.comm_seconds
    control0 = getattr(runner, "control_seconds", 0.0)
    start = time.perf_counter()
    runner.execute(plan)
    wall = time.perf_counter() - start
    return (wall, tp_group.comm_seconds - comm0,
            getattr(runner, "control_seconds", 0.0) - control0)


def _summary(samples: list[tuple[float, float, float]]) -> dict:
    walls = [s[0] for s in samples]
    total = sum(walls)
    return {"iter_ms": 1e3 * statistics.median(walls),
            "collectives_ms": 1e3 * sum(s[1] for s in samples) / len(samples),
            "collectives_share": sum(s[1] for s in samples) / total,
            "control_ms": 1e3 * sum(s[2] for s in samples) / len(samples)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: smollm2-135m")
    p.add_argument("--tp", type=int, default=3, help="the tp=N to compare with tp=1")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--iters", type=int, default=8)
    args = p.parse_args()

    source = resolve_model(args.model)
    cfg = load_model_config(source)
    rc = RunnerConfig(num_kv_blocks=num_blocks(args), block_size=BLOCK, dtype=args.dtype,
                      seed=0, progress=False)
    rows = []
    cores = os.cpu_count() or 1
    per_rank = max(1, cores // args.tp)
    single = ModelRunner(cfg, source, rc)
    # tp=1 with every core, and with the threads one rank gets at tp=N: on a shared,
    # oversubscribed CPU the multi-threaded run can be the slow one
    for threads in sorted({cores, per_rank}, reverse=True):
        torch.set_num_threads(threads)
        single.requests.clear()
        for name, r in measure(single, single.tp, cfg, args).items():
            rows.append({"workload": name, "tp": 1, "threads": threads, **r})
    torch.set_num_threads(cores)
    del single
    executor = launch_tp_executor(cfg, source, rc, args.tp)
    try:
        executor.tp.timed = True
        for name, r in measure(executor, executor.tp, cfg, args).items():
            rows.append({"workload": name, "tp": args.tp, "threads": per_rank, **r})
    finally:
        executor.shutdown()
    rows.sort(key=lambda r: (r["workload"], r["tp"], -r["threads"]))
    print(f"{source.name}, {cfg.num_layers} layers: per forward {2 * cfg.num_layers + 1} "
          f"all-reduces + 1 all-gather at tp>1; threads = torch threads per rank")
    print_table(rows, ["workload", "tp", "threads", "iter_ms", "collectives_ms",
                       "collectives_share", "control_ms"])


if __name__ == "__main__":
    main()
