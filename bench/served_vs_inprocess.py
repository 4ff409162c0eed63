"""The cost of the message queue: the same engine in-process vs served through Redis.

One workload a round (random token-id prompts, default 64 of 100-200 tokens, 64 new tokens
each, greedy, EOS ignored; each round's prompts its own, so that none is found in a prefix
cache; `--same-prompts --no-prefix-caching`: one set for every round, to see how far the
schedule moves from run to run) with at most 32 requests in flight, run two ways in one process's run, alternating A,
B, A, B … (the machine is shared and noisy):

  A  in-process: `LLMEngine` stepped in a loop; a request enters when one finishes (like
     `--max-concurrency 32`); times from the step outputs (TTFT: added -> first token; ITL:
     gaps between a request's tokens).
  B  served: `pacer up` (redis-server, scheduler, worker, gateway as processes) on free ports
     with the same engine flags, driven over HTTP by the `pacer bench` client code; the same
     token ids are sent as the prompt. The worker's plan-wait share is read from the Redis
     `stats` hash while the run goes (the gateway's /metrics does not carry it).

  C  with `--also-no-overlap`: a second `pacer up --no-overlap` (the scheduler plans each
     iteration only once the last result is in, docs/design.md#overlap), driven like B;
     the rounds go A, B, C, A, B, C ...
  H  with `--also-http`: the same engine and an HTTP server in one process, no Redis
     (bench/inprocess_http.py), driven like B. A pays nothing to stream tokens; H pays what
     any server on these cores pays (detokenizing, SSE, a socket write and a client read per
     token); B/H is what the Redis hops and the split into processes cost on top.

Prints output tokens/s of each, the ratio served/in-process (target >= 0.95), with H also
served/H, TTFT/ITL
medians, the worker's plan-wait share, and for context other engines' figures measured
earlier.

    python bench/served_vs_inprocess.py [--repeats 2] [--num-prompts 64] [--json out.json]
        [--also-no-overlap] [--also-http] [engine flags: --dtype, --kv-cache-memory, ...]
"""
from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import engine_arg_parser, print_table, write_json  # noqa: E402
from services.bench_client import (ApiTarget, RequestResult, SendOptions,  # noqa: E402
                                   compute_metrics, error_summary, run_requests)
from services.bench_cmd import run_async  # noqa: E402
from services.bench_dataset import BenchRequest, random_dataset  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.up import engine_flags  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.keys import Keys  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 300.0
STATS_POLL_S = 0.25

# Measured earlier on this kind of machine (2 vCPU EPYC, 2026-11-29), same model, 32 concurrent
# streams, ~106-token prompts, 64 new tokens. Context only: not measured in this run.
REFERENCE = [
    {"engine": "vLLM CPU 0.32 (bf16)", "tok_s": 361, "median_ttft_s": 1.4, "median_itl_ms": 65},
    {"engine": "llama.cpp server (Q4_1, 32 slots)", "tok_s": 104, "median_ttft_s": 6.7,
     "median_itl_ms": 214},
    {"engine": "transformers generate (bf16, batch 16)", "tok_s": 199, "median_ttft_s": None,
     "median_itl_ms": None},
]


# ---- A: in-process -----------------------------------------------------------------------

def run_inprocess(engine: LLMEngine, requests: list[BenchRequest],
                  concurrency: int) -> tuple[list[RequestResult], float, dict]:
    """Step the engine with at most `concurrency` requests in it; time tokens as they come.

    Also returns the iterations it took and the time inside `step()` per iteration, to set
    beside the served worker's (more iterations, or slower ones?)."""
    pending = deque(requests)
    live: dict[str, tuple[RequestResult, list[float]]] = {}   # id -> (result, [last token at])
    results: list[RequestResult] = []
    start = time.perf_counter()
    steps, step_s = 0, 0.0
    while pending or live:
        while pending and len(live) < concurrency:
            req = pending.popleft()
            sp = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
            r = RequestResult(prompt_len=req.prompt_len, sent_at=time.perf_counter())
            live[engine.add_request(req.prompt, sp)] = (r, [])
            results.append(r)
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps, step_s = steps + 1, step_s + now - before
        for out in outputs:
            r, last = live[out.request_id]
            for _ in out.new_tokens:
                if r.ttft is None:
                    r.ttft = now - r.sent_at
                else:
                    r.itl.append(now - last[0])
                last[:] = [now]
                r.output_tokens += 1
            if out.finished:
                r.e2el = now - r.sent_at
                r.success = out.finish_reason == "length"
                r.error = "" if r.success else f"finished with {out.finish_reason}"
                del live[out.request_id]
    return results, time.perf_counter() - start, {"iterations": steps,
                                                   "step_ms_it": step_s / max(steps, 1) * 1e3}


# ---- B: served ---------------------------------------------------------------------------

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServedSystem:
    proc: subprocess.Popen
    base_url: str
    redis_url: str | None   # None: bench/inprocess_http.py, no Redis and no stats to read
    log_path: str
    model: str           # the served model name

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()      # `pacer up` stops its children in order on SIGTERM
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_served(engine_args: EngineArgs, model: str, log_path: str,
                 extra: tuple[str, ...] = (), http_only: bool = False) -> ServedSystem:
    """`pacer up` with these engine flags (and `extra` flags) on free ports, once healthy;
    with `http_only`, bench/inprocess_http.py instead (no Redis)."""
    port, redis_port = free_port(), free_port()
    redis_url = None if http_only else f"redis://127.0.0.1:{redis_port}/0"
    argv = [os.path.join(ROOT, "bench", "inprocess_http.py"), "--port", str(port)] \
        if http_only else ["-m", "services.cli", "up", "--port", str(port),
                           "--redis-url", redis_url, "--log-level", "warning"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *argv, *engine_flags(engine_args), *extra],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    system = ServedSystem(proc, f"http://127.0.0.1:{port}", redis_url, log_path, model)
    end = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"pacer up exited with {proc.returncode}; log: {log_path}, "
                               f"ending:\n{tail}")
        try:
            with urllib.request.urlopen(f"{system.base_url}/health", timeout=2.0) as r:
                if r.status == 200:
                    return system
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.5)
    system.stop()
    raise RuntimeError(f"pacer up not healthy after {STARTUP_TIMEOUT_S} s; log: {log_path}")


WORKER_FIELDS = ("worker_plan_wait_seconds_total", "worker_busy_seconds_total",
                 "worker_forward_seconds_total", "worker_publish_seconds_total",
                 "worker_iterations_total", "scheduler_overhead_seconds_total",
                 "scheduler_overhead_iterations_total")


async def poll_stats(redis_url: str, stop: asyncio.Event) -> list[dict[str, float]]:
    """Snapshots of the `stats` hash every STATS_POLL_S until `stop`."""
    import redis.asyncio as aioredis
    client = aioredis.Redis.from_url(redis_url)
    snaps = []
    try:
        while True:
            raw = await client.hgetall(Keys().stats)
            snaps.append({k.decode(): float(v) for k, v in raw.items()})
            if stop.is_set():
                return snaps
            try:
                await asyncio.wait_for(stop.wait(), STATS_POLL_S)
            except asyncio.TimeoutError:
                pass
    finally:
        await client.aclose()


def plan_wait_share(snaps: list[dict[str, float]]) -> dict:
    """The worker's time split over the run, from stats snapshots.

    The worker adds an idle gap to its wait total only when the next plan arrives, so the
    baseline is the first snapshot written during the run (iterations already moved past the
    run's starting value): the idle time before the run is inside it and drops out.
    """
    if not snaps or "worker_iterations_total" not in snaps[-1]:
        return {"available": False}
    first_iters = snaps[0].get("worker_iterations_total", 0.0)
    base = next((s for s in snaps if s.get("worker_iterations_total", 0.0) > first_iters), None)
    last = snaps[-1]
    if base is None or last["worker_iterations_total"] <= base["worker_iterations_total"]:
        return {"available": False}
    d = {f: last.get(f, 0.0) - base.get(f, 0.0) for f in WORKER_FIELDS}
    total = d["worker_plan_wait_seconds_total"] + d["worker_busy_seconds_total"] + \
        d["worker_publish_seconds_total"]
    iters = d["worker_iterations_total"]
    sched_iters = d["scheduler_overhead_iterations_total"]
    return {"available": True, "iterations": int(iters),
            "plan_wait_share": d["worker_plan_wait_seconds_total"] / total,
            "publish_share": d["worker_publish_seconds_total"] / total,
            "plan_wait_ms_per_iteration": d["worker_plan_wait_seconds_total"] / iters * 1e3,
            "busy_ms_per_iteration": d["worker_busy_seconds_total"] / iters * 1e3,
            "forward_ms_per_iteration": d["worker_forward_seconds_total"] / iters * 1e3,
            "scheduler_overhead_ms_per_iteration":
                d["scheduler_overhead_seconds_total"] / sched_iters * 1e3 if sched_iters else None}


async def _served_pass(system: ServedSystem, requests: list[BenchRequest], concurrency: int):
    target = ApiTarget(system.base_url, "/v1/completions", system.model)
    opts = SendOptions(temperature=0.0, ignore_eos=True, timeout_s=600.0)
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_stats(system.redis_url, stop)) if system.redis_url \
        else None
    try:
        results, duration = await run_requests(target, requests, opts,
                                               max_concurrency=concurrency)
    finally:
        stop.set()
        snaps = await poller if poller is not None else []
    return results, duration, plan_wait_share(snaps)


def run_served(system: ServedSystem, requests: list[BenchRequest], concurrency: int):
    return run_async(_served_pass(system, requests, concurrency))    # uvloop, as pacer bench


# ---- report ------------------------------------------------------------------------------

def row(mode: str, round_no: int, results, duration: float, extra: dict | None = None) -> dict:
    m = compute_metrics(results, duration)
    out = {"mode": mode, "round": round_no, "ok": m["completed"], "failed": m["failed"],
           "seconds": duration, "tok_s": m["output_throughput"],
           "ttft_med_ms": m["median_ttft_ms"], "ttft_p99_ms": m["p99_ttft_ms"],
           "itl_med_ms": m["median_itl_ms"], "itl_p99_ms": m["p99_itl_ms"],
           "tpot_med_ms": m["median_tpot_ms"], "errors": error_summary(results)}
    if extra and "step_ms_it" in extra:           # in-process
        out["iterations"] = extra["iterations"]
        out["busy_ms_it"] = extra["step_ms_it"]
    if extra and extra.get("available"):
        out["iterations"] = extra["iterations"]
        out["plan_wait_share"] = extra["plan_wait_share"]
        out["plan_wait_ms_it"] = extra["plan_wait_ms_per_iteration"]
        out["busy_ms_it"] = extra["busy_ms_per_iteration"]
        out["forward_ms_it"] = extra["forward_ms_per_iteration"]
        out["sched_ms_it"] = extra["scheduler_overhead_ms_per_iteration"]
    return out


NO_OVERLAP = "served --no-overlap"
HTTP = "in-process + HTTP"


def summary(rows: list[dict]) -> dict:
    def med(mode, key):
        vals = [r[key] for r in rows if r["mode"] == mode and r.get(key) is not None]
        return statistics.median(vals) if vals else None
    a, b, c = med("in-process", "tok_s"), med("served", "tok_s"), med(NO_OVERLAP, "tok_s")
    h = med(HTTP, "tok_s")
    return {"inprocess_tok_s": a, "served_tok_s": b, "ratio": b / a if a and b else None,
            "http_tok_s": h, "served_over_http": b / h if b and h else None,
            "http_over_inprocess": h / a if a and h else None,
            "http_itl_med_ms": med(HTTP, "itl_med_ms"),
            "inprocess_ttft_med_ms": med("in-process", "ttft_med_ms"),
            "served_ttft_med_ms": med("served", "ttft_med_ms"),
            "inprocess_itl_med_ms": med("in-process", "itl_med_ms"),
            "served_itl_med_ms": med("served", "itl_med_ms"),
            "served_plan_wait_share": med("served", "plan_wait_share"),
            "no_overlap_tok_s": c, "no_overlap_ratio": c / a if a and c else None,
            "no_overlap_itl_med_ms": med(NO_OVERLAP, "itl_med_ms"),
            "no_overlap_plan_wait_share": med(NO_OVERLAP, "plan_wait_share")}


def print_report(rows: list[dict], s: dict) -> None:
    print()
    print_table(rows, ["mode", "round", "ok", "failed", "seconds", "tok_s", "ttft_med_ms",
                       "ttft_p99_ms", "itl_med_ms", "itl_p99_ms", "tpot_med_ms",
                       "iterations", "plan_wait_share", "plan_wait_ms_it", "busy_ms_it", "forward_ms_it",
                       "sched_ms_it"])
    for r in rows:
        for message, count in r["errors"]:
            print(f"  {r['mode']} round {r['round']}: failed x{count}: {message}")
    print(f"\nmedians over rounds: in-process {s['inprocess_tok_s']:.1f} tok/s, "
          f"served {s['served_tok_s']:.1f} tok/s, served/in-process = {s['ratio']:.2f}x "
          f"(target >= 0.95)")
    if s["http_tok_s"] is not None:
        print(f"  in-process + HTTP {s['http_tok_s']:.1f} tok/s: {s['http_over_inprocess']:.2f}x "
              f"in-process (streaming over HTTP on these cores); served / it = "
              f"{s['served_over_http']:.2f}x (the Redis hops and the processes)")
    if s["no_overlap_tok_s"] is not None:
        print(f"  served --no-overlap {s['no_overlap_tok_s']:.1f} tok/s, "
              f"{s['no_overlap_ratio']:.2f}x in-process")
    print(f"  median TTFT: in-process {s['inprocess_ttft_med_ms']:.0f} ms, served "
          f"{s['served_ttft_med_ms']:.0f} ms; median ITL: in-process "
          f"{s['inprocess_itl_med_ms']:.1f} ms, served {s['served_itl_med_ms']:.1f} ms")
    share = s["served_plan_wait_share"]
    print("  worker waited for plans: " + ("not reported by the served system" if share is None
                                           else f"{share:.1%} of its time"))
    print("\nreference (measured earlier, not in this run; 32 streams, ~106-token prompts, "
          "64 new tokens):")
    print_table(REFERENCE, ["engine", "tok_s", "median_ttft_s", "median_itl_ms"])


def main() -> None:
    ap = engine_arg_parser(__doc__)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=150)
    ap.add_argument("--range-ratio", type=float, default=0.33, help="150 ± 33%%: 100-200 tokens")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="A, B rounds (alternated)")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the workload")
    ap.add_argument("--also-no-overlap", action="store_true",
                    help="a third mode each round: pacer up --no-overlap")
    ap.add_argument("--same-prompts", action="store_true",
                    help="every round the same prompts (with --no-prefix-caching, so that none "
                         "is found cached): how far a schedule moves from run to run")
    ap.add_argument("--also-http", action="store_true",
                    help="a mode each round: the engine behind an HTTP server in one process "
                         "(bench/inprocess_http.py), no Redis")
    args = ap.parse_args()
    engine_args = EngineArgs.from_cli(args)
    if args.same_prompts and engine_args.enable_prefix_caching:
        ap.error("--same-prompts needs --no-prefix-caching: a repeated prompt would be found "
                 "in the prefix cache, and the round would time its decodes alone")

    engine = LLMEngine(engine_args, progress=False)
    # prompt lengths vary (uniform, as vLLM's random dataset); output lengths are fixed. Each
    # round has prompts of its own (seed + round): a round that repeated the last one's would
    # find them in the prefix cache of both systems and time decodes alone.
    def workload(seed: int) -> list[BenchRequest]:
        return [BenchRequest(r.prompt, r.prompt_len, args.output_len) for r in
                random_dataset(engine.tokenizer, args.num_prompts, args.input_len,
                               args.output_len, args.range_ratio, seed, as_token_ids=True)]
    requests = workload(args.data_seed)
    n_tokens = sum(r.prompt_len for r in requests)
    print(f"{len(requests)} prompts ({n_tokens} prompt tokens, "
          f"{min(r.prompt_len for r in requests)}-{max(r.prompt_len for r in requests)} each), "
          f"{args.output_len} new tokens each, concurrency {args.concurrency}, "
          f"engine flags: {' '.join(engine_flags(engine_args))}", flush=True)
    warm = requests[:2]        # seed's own prompts; the rounds' come from seed + 1, + 2, ...
    run_inprocess(engine, warm, args.concurrency)   # (first-call costs out of the rounds)

    log_path = os.path.join(tempfile.mkdtemp(prefix="served-vs-inprocess-"), "pacer-up.log")
    print(f"starting pacer up (log: {log_path}) ...", flush=True)
    systems = {"served": start_served(engine_args, engine.source.name, log_path)}
    rows = []
    try:
        if args.also_no_overlap:
            systems[NO_OVERLAP] = start_served(engine_args, engine.source.name,
                                               log_path + ".no-overlap", ("--no-overlap",))
        if args.also_http:
            systems[HTTP] = start_served(engine_args, engine.source.name, log_path + ".http",
                                         http_only=True)
        for system in systems.values():
            run_served(system, warm, args.concurrency)
        for i in range(args.repeats):
            # the warm-up's are seed's own
            requests = workload(args.data_seed + 1 + (0 if args.same_prompts else i))
            results, duration, steps = run_inprocess(engine, requests, args.concurrency)
            rows.append(row("in-process", i, results, duration, steps))
            print(f"  round {i} in-process: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
            for mode, system in systems.items():
                results, duration, stats = run_served(system, requests, args.concurrency)
                rows.append(row(mode, i, results, duration, stats))
                print(f"  round {i} {mode}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    finally:
        for system in systems.values():
            system.stop()
    s = summary(rows)
    print_report(rows, s)
    write_json(args.json, {"rows": rows, "summary": s, "reference_not_this_run": REFERENCE,
                           "engine_flags": engine_flags(engine_args)})


if __name__ == "__main__":
    main()
