"""Prefix caching and cache-aware routing, measured through the served system in one run
(docs/design.md#prefix-caching, docs/design.md#cache-aware-routing).

Workloads (services/bench_dataset.py, token-id prompts, greedy, EOS ignored), each sent by the
`pacer bench` client code with at most `--max-concurrency` requests in flight:

  shared   `--num-prefixes` system prompts of `--prefix-len` tokens, `--num-prompts` requests,
           each one of them plus a user turn of `--input-len` tokens
  unique   `--num-unique` random prompts of the same total length: no prefix to share

Servers (`pacer up` on free ports, the default model unless flags say otherwise):

  on       one engine, prefix caching on (the default), `--kv-blocks` KV blocks
  off      the same, `--no-prefix-caching`
  prefix   `--replicas 2 --router prefix`, `--kv-blocks` / 2 blocks each (the same memory)
  rr       `--replicas 2 --router round-robin`, the same

Reported: TTFT median and output/total throughput of `shared` on vs off (target: TTFT >= 3x
better cached); throughput of `unique` on vs off (the cost of caching when nothing is shared,
target <= 2 %; on a shared machine the served figure's noise is larger than that, so the
scheduling core is also timed alone on `unique`, caching on vs off, best of 5 alternated: the
host time caching adds is all it can add, the plans and workers being the same); hit rate (from /metrics, in tokens) and TTFT of `shared` on one engine, with
prefix routing and with round-robin (target: prefix routing keeps >= 90 % of the one-engine
hit rate), how many requests and distinct system prompts each replica got, and how many
system prompts both replicas served (each computed and cached twice).

    python bench/prefix_cache.py [--num-prompts 128] [--num-prefixes 8] [--prefix-len 1024]
        [--input-len 64] [--output-len 16] [--max-concurrency 16] [--kv-blocks 768]
        [--num-unique 64] [--data-seed 0] [--json docs/prefix_cache.json] [engine flags]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import redis  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from bench.served_vs_inprocess import ServedSystem, start_served  # noqa: E402
from services.bench_client import (ApiTarget, SendOptions, compute_metrics,  # noqa: E402
                                   error_summary, run_requests)
from services.bench_cmd import (prefix_cache_counters, prefix_cache_hit_rate,  # noqa: E402
                                run_async)
from services.bench_dataset import (BenchRequest, random_dataset,  # noqa: E402
                                    shared_prefix_dataset)
from services.up import engine_flags  # noqa: E402
from scheduler_svc.build import build_scheduler  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402
from shared.engine_layout import engine_layout  # noqa: E402
from shared.plan import SampledToken, StepResult  # noqa: E402
from shared.protocol import from_fields  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.keys import Keys  # noqa: E402
from shared.model_source import resolve_model  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

SERVERS = {"on": (), "off": ("--no-prefix-caching",),
           "prefix": ("--replicas", "2", "--router", "prefix"),
           "rr": ("--replicas", "2", "--router", "round-robin")}
FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
               "amx_tile")


def run_pass(system: ServedSystem, requests: list[BenchRequest], concurrency: int) -> dict:
    target = ApiTarget(system.base_url, "/v1/completions", system.model)
    opts = SendOptions(temperature=0.0, ignore_eos=True, timeout_s=1200.0)
    before = prefix_cache_counters(system.base_url)
    results, duration = run_async(run_requests(target, requests, opts,
                                               max_concurrency=concurrency))
    time.sleep(0.3)          # the stats hash is written at most every 0.1 s
    m = compute_metrics(results, duration)
    return {"ok": m["completed"], "failed": m["failed"], "seconds": round(duration, 2),
            "ttft_med_ms": m["median_ttft_ms"], "ttft_p99_ms": m["p99_ttft_ms"],
            "out_tok_s": m["output_throughput"], "total_tok_s": m["total_token_throughput"],
            "hit_rate_pct": prefix_cache_hit_rate(before, prefix_cache_counters(system.base_url)),
            "errors": error_summary(results)}


def core_seconds(engine_args: EngineArgs, requests: list[BenchRequest]) -> float:
    """CPU seconds the scheduling core alone takes to run `requests` (all at once) to the
    end, every sampling row drawing a dummy token."""
    sched = build_scheduler(engine_layout(engine_args))
    for i, r in enumerate(requests):
        sched.add_request(str(i), list(r.prompt), SamplingParams(max_tokens=r.output_len,
                                                                  ignore_eos=True))
    token = SampledToken(5)
    started = time.process_time()
    while sched.has_unfinished():
        plan = sched.schedule()
        rows = plan.num_scheduled_tokens
        sampled = {rid: token for rid, n in rows.items()
                   if sched.get_request(rid).num_uncomputed_tokens == n}
        sched.update(plan, StepResult(plan.step, sampled))
    return time.process_time() - started


def core_overhead(engine_args: EngineArgs, requests: list[BenchRequest],
                  repeats: int = 5) -> dict:
    best = {True: float("inf"), False: float("inf")}
    for _ in range(repeats):
        for caching in (True, False):
            args = replace(engine_args, enable_prefix_caching=caching)
            best[caching] = min(best[caching], core_seconds(args, requests))
    return {"core_s_caching_on": round(best[True], 4), "core_s_caching_off": round(best[False], 4),
            "core_ms_added_per_request": round((best[True] - best[False]) * 1e3 / len(requests),
                                               4)}


def placement(system: ServedSystem, requests: list[BenchRequest], prefix_len: int) -> dict:
    """Where the requests of `requests` went (each replica's stream keeps its entries after
    XACK): how many each replica carried, how many distinct system prompts each served, and
    how many system prompts were served by both (each such copy was computed and cached
    twice)."""
    prefix_of = {tuple(r.prompt[:prefix_len]) for r in requests}
    r = redis.Redis.from_url(system.redis_url)
    try:
        served: list[set] = []
        counts = []
        for i in range(2):
            stream = Keys().for_instance(f"r{i}").instance_requests
            prompts = [from_fields(fields).prompt_token_ids for _, fields in r.xrange(stream)]
            mine = [tuple(p[:prefix_len]) for p in prompts if tuple(p[:prefix_len]) in prefix_of]
            counts.append(len(mine))
            served.append(set(mine))
    finally:
        r.close()
    return {"per_replica": counts, "prefixes_per_replica": [len(s) for s in served],
            "prefixes_on_both": len(served[0] & served[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(ap)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-unique", type=int, default=64,
                    help="0: no unique workload (nor the core's timing on it)")
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=768,
                    help="KV blocks of the one engine; each of 2 replicas gets half")
    ap.add_argument("--servers", default=",".join(SERVERS),
                    help=f"which to run, of {','.join(SERVERS)}")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the workloads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine_args = EngineArgs.from_cli(args)
    source = resolve_model(engine_args.model)
    tokenizer = load_tokenizer(source)
    shared = shared_prefix_dataset(tokenizer, args.num_prompts, args.num_prefixes,
                                   args.prefix_len, args.input_len, args.output_len,
                                   seed=args.data_seed, as_token_ids=True)
    unique = random_dataset(tokenizer, args.num_unique, args.prefix_len + args.input_len,
                            args.output_len, seed=args.data_seed + 1, as_token_ids=True)
    warm = random_dataset(tokenizer, 4, 64, 4, seed=args.data_seed + 2, as_token_ids=True)
    flags = sorted(set(FLAGS_SHOWN) & set(cpu_flags()))
    print(f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
          f"flags {' '.join(flags)}; shared: {len(shared)} requests over {args.num_prefixes} "
          f"prefixes of {args.prefix_len} + {args.input_len} tokens; unique: {len(unique)} of "
          f"{args.prefix_len + args.input_len}; {args.output_len} new tokens each; "
          f"concurrency {args.max_concurrency}", flush=True)
    core = core_overhead(replace(engine_args, num_kv_blocks=args.kv_blocks), unique) \
        if unique else {}
    print(f"scheduling core alone on unique: {core}", flush=True)
    rows, tmp = [], tempfile.mkdtemp(prefix="prefix-cache-")
    for name in args.servers.split(","):
        replicas = name in ("prefix", "rr")
        blocks = args.kv_blocks // 2 if replicas else args.kv_blocks
        log_path = os.path.join(tmp, f"{name}.log")
        print(f"server {name}: pacer up {' '.join(SERVERS[name])} --num-kv-blocks {blocks} "
              f"(log: {log_path})", flush=True)
        # a context the replicas' halved pools hold (pacer up refuses a smaller pool), far
        # longer than these prompts
        system = start_served(replace(engine_args, num_kv_blocks=blocks,
                                      max_model_len=engine_args.max_model_len or 2048),
                              source.name,
                              log_path, SERVERS[name])
        try:
            run_pass(system, warm, args.max_concurrency)
            workloads = [("unique", unique), ("shared", shared)] \
                if name in ("on", "off") and unique else [("shared", shared)]
            for workload, requests in workloads:
                row = {"server": name, "workload": workload,
                       **run_pass(system, requests, args.max_concurrency)}
                if replicas:
                    row.update(placement(system, requests, args.prefix_len))
                rows.append(row)
                print(f"  {workload}: {row}", flush=True)
        finally:
            system.stop()
    print_table(rows, ["server", "workload", "ok", "seconds", "ttft_med_ms", "ttft_p99_ms",
                       "out_tok_s", "total_tok_s", "hit_rate_pct", "per_replica",
                       "prefixes_per_replica", "prefixes_on_both"])
    summary = summarize(rows)
    summary.update(core)
    if ("on", "unique") in {(r["server"], r["workload"]) for r in rows}:
        served = next(r for r in rows if r["server"] == "on" and r["workload"] == "unique")
        summary["core_added_share_of_served_time_pct"] = round(
            100 * (core["core_s_caching_on"] - core["core_s_caching_off"]) / served["seconds"], 4)
    for key, value in summary.items():
        print(f"{key}: {value}")
    write_json(args.json, {"rows": rows, "summary": summary, "cpu_flags": flags,
                           "cores": len(os.sched_getaffinity(0)),
                           "engine_flags": engine_flags(engine_args), "config": {
                               k: v for k, v in vars(args).items()
                               if k in ("num_prompts", "num_prefixes", "prefix_len", "input_len",
                                        "output_len", "num_unique", "max_concurrency",
                                        "kv_blocks", "data_seed")}})


def summarize(rows: list[dict]) -> dict:
    by = {(r["server"], r["workload"]): r for r in rows}
    out = {}

    def ratio(a, b, key):
        if a in by and b in by and by[b][key]:
            return round(by[a][key] / by[b][key], 3)
        return None
    out["shared_ttft_off_over_on"] = ratio(("off", "shared"), ("on", "shared"), "ttft_med_ms")
    out["shared_throughput_on_over_off"] = ratio(("on", "shared"), ("off", "shared"),
                                                 "total_tok_s")
    out["unique_throughput_on_over_off"] = ratio(("on", "unique"), ("off", "unique"),
                                                 "total_tok_s")
    for server in ("on", "prefix", "rr"):
        if (server, "shared") in by:
            out[f"hit_rate_{server}_pct"] = by[(server, "shared")]["hit_rate_pct"]
    out["prefix_hit_rate_over_one_engine"] = ratio(("prefix", "shared"), ("on", "shared"),
                                                   "hit_rate_pct")
    out["rr_hit_rate_over_one_engine"] = ratio(("rr", "shared"), ("on", "shared"),
                                               "hit_rate_pct")
    out["ttft_rr_over_prefix"] = ratio(("rr", "shared"), ("prefix", "shared"), "ttft_med_ms")
    return out


if __name__ == "__main__":
    main()
