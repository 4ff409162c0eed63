"""Where a served token's CPU goes: each process of a running `pacer up` (its event-loop
thread and its other threads apart), per worker iteration, while the `pacer bench` client
drives it. Read from /proc before and after the run (Linux), so it costs the services nothing.

    python bench/services_cpu.py --base-url http://127.0.0.1:8000 \
        --redis-url redis://127.0.0.1:6379/0 [--max-concurrency 1] [--num-prompts 16] [--rounds 1]

The processes are found by the `--redis-url` on their command line (`pacer up` passes it to
each service) and the redis-server by its port; the iterations are rank 0's
`worker_iterations_total`, read from its heartbeat. On a machine with few cores, what the services
take is what the forward cannot have (docs/benchmarks.md#served-through-redis-vs-in-process).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from urllib.parse import urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import cpu_ticks, print_table, run_random_workload, thread_ids  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402
from shared.keys import HEARTBEAT_INTERVAL_S  # noqa: E402


def find_processes(redis_url: str) -> dict[int, str]:
    """pid -> name of the services that talk to `redis_url` ("scheduler decode", "worker
    prefill 0": the service, its P/D role if any, its rank) and of its redis-server."""
    port = str(urlparse(redis_url).port or 6379)
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if "services.cli" in argv and redis_url in argv:
            role = argv[argv.index("services.cli") + 1]
            if role != "up":
                name = [role] + [argv[argv.index(flag) + 1] for flag in ("--role", "--rank")
                                 if flag in argv[:-1]]
                found[int(pid)] = " ".join(name)
        elif argv and os.path.basename(argv[0]).startswith("redis-server") \
                and any(a.endswith(f":{port}") or a == port for a in argv):
            found[int(pid)] = "redis-server"
    return found


def thread_ticks(pid: int) -> dict[int, int]:
    """tid -> user + system clock ticks so far."""
    return {tid: cpu_ticks(f"/proc/{pid}/task/{tid}/stat") for tid in thread_ids(pid)}


def worker_iterations(redis_url: str, prefix: str) -> int:
    """Rank 0's iterations so far, from its heartbeat: refreshed every HEARTBEAT_INTERVAL_S
    whatever the traffic (the stats hash is written only beside a result, so it can miss the
    last iterations of a run)."""
    import redis
    from shared.keys import Keys
    from shared.protocol import decode
    value = redis.Redis.from_url(redis_url).get(Keys(prefix).hb_worker(0))
    if value is None:
        raise SystemExit("no worker heartbeat at this Redis and prefix: is rank 0 serving there?")
    return int(decode(value).extra["worker_iterations_total"])


def served_model(base_url: str) -> str:
    import json
    import urllib.request
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def measure(args) -> tuple[list[dict], dict]:
    procs = find_processes(args.redis_url)
    if not procs:
        raise SystemExit(f"no pacer services found with --redis-url {args.redis_url}")
    model = served_model(args.base_url)
    before = {pid: thread_ticks(pid) for pid in procs}
    iterations = worker_iterations(args.redis_url, args.key_prefix)
    m = run_random_workload(args.base_url, model, args.num_prompts, args.max_concurrency,
                            args.seed, args.input_len, args.output_len, args.model)
    time.sleep(HEARTBEAT_INTERVAL_S * 2)      # a heartbeat written after the run's end
    iterations = worker_iterations(args.redis_url, args.key_prefix) - iterations
    per_it = 1e3 / os.sysconf("SC_CLK_TCK") / max(iterations, 1)
    rows = []
    for pid, name in sorted(procs.items(), key=lambda kv: kv[1]):
        spent = {tid: t - before[pid].get(tid, 0) for tid, t in thread_ticks(pid).items()}
        main, others = spent.pop(pid, 0), sum(spent.values())
        rows.append({"process": name, "pid": pid, "event_loop_ms": main * per_it,
                     "other_threads_ms": others * per_it, "total_ms": (main + others) * per_it})
    return rows, {"iterations": iterations, "tok_s": m["output_throughput"],
                  "median_itl_ms": m.get("median_itl_ms"), "failed": m["failed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--key-prefix", default="pacer:")
    ap.add_argument("--model", default=None, help="for the tokenizer (default: the default model)")
    ap.add_argument("--max-concurrency", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=106)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
                     if f in cpu_flags())
    print(f"CPU flags: {flags}; cores: {os.cpu_count()}")
    first_seed = args.seed
    for rnd in range(args.rounds):
        args.seed = first_seed + rnd          # fresh prompts each round
        rows, run = measure(args)
        print(f"round {rnd + 1}: {run['iterations']} iterations, {run['tok_s']:.1f} tok/s, "
              f"median ITL {run['median_itl_ms']:.2f} ms, failed {run['failed']}; "
              "CPU ms per iteration:")
        print_table(rows, ["process", "pid", "event_loop_ms", "other_threads_ms", "total_ms"])


if __name__ == "__main__":
    main()
