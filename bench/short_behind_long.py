"""Short prompts arriving behind long ones, served (docs/design.md#short-prompts-beside-long-ones):
how long a one-line request waits for its first token while other users' long documents are
prefilled.

`pacer up` at the defaults on free ports (the default model, or `--model`); `--long` prompts of
`--long-len` random tokens sent 0.1 s apart, then `--short` prompts of `--short-len` tokens
every 0.5 s from 1 s on; greedy, EOS ignored. Printed per request: when it was sent and its
time to first token; then the short prompts' median and worst TTFT, the long ones', and how
long the whole load took. `--repeats` starts a fresh `pacer up` for each run.

    python bench/short_behind_long.py [--long 4] [--long-len 3900] [--short 8] [--short-len 16]
        [--repeats 1] [--json out.json] [engine flags as `pacer up`'s: --dtype ...]
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402

from bench.common import engine_arg_parser, print_table, random_prompts, write_json  # noqa: E402
from bench.served_vs_inprocess import start_served  # noqa: E402
from services.bench_client import ApiTarget, SendOptions, send_request  # noqa: E402
from services.bench_dataset import BenchRequest  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.model_config import load_model_config  # noqa: E402
from shared.model_source import resolve_model  # noqa: E402

SHORT_FROM_S, SHORT_EVERY_S, LONG_EVERY_S = 1.0, 0.5, 0.1


async def one_run(base_url: str, model: str, longs: list[list[int]], shorts: list[list[int]],
                  args) -> list[dict]:
    target = ApiTarget(base_url, "/v1/completions", model)
    opts = SendOptions(temperature=0.0, ignore_eos=True, timeout_s=900.0)
    plan = [("long", p, LONG_EVERY_S * i, args.long_tokens) for i, p in enumerate(longs)]
    plan += [("short", p, SHORT_FROM_S + SHORT_EVERY_S * i, args.short_tokens)
             for i, p in enumerate(shorts)]

    async with aiohttp.ClientSession() as session:
        async def later(prompt: list[int], at: float, tokens: int):
            await asyncio.sleep(at)
            return await send_request(session, target, BenchRequest(prompt, len(prompt), tokens),
                                      opts)
        results = await asyncio.gather(*(later(p, at, n) for _, p, at, n in plan))
    bad = [r.error for r in results if not r.success]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0]}")
    return [{"kind": kind, "sent_s": at, "ttft_s": r.ttft}
            for (kind, _, at, _), r in zip(plan, results)]


def main() -> None:
    ap = engine_arg_parser(__doc__)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-len", type=int, default=3900)
    ap.add_argument("--long-tokens", type=int, default=8)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--short-len", type=int, default=16)
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    engine = EngineArgs.from_cli(args)
    source = resolve_model(engine.model)
    cfg = load_model_config(source)
    avoid = tuple(cfg.eos_token_ids)
    logs = tempfile.mkdtemp(prefix="pacer-short-behind-long-")
    runs, rows = [], []
    for rep in range(args.repeats):
        longs = random_prompts(args.long, args.long_len, args.long_len, cfg.vocab_size,
                               10 + rep, avoid)
        shorts = random_prompts(args.short, args.short_len, args.short_len, cfg.vocab_size,
                                20 + rep, avoid)
        system = start_served(engine, source.name, os.path.join(logs, f"run-{rep}.log"))
        try:
            began = time.perf_counter()
            requests = asyncio.run(one_run(system.base_url, source.name, longs, shorts, args))
            took = time.perf_counter() - began
        finally:
            system.stop()
        runs.append(requests)
        short = [r["ttft_s"] for r in requests if r["kind"] == "short"]
        long = [r["ttft_s"] for r in requests if r["kind"] == "long"]
        rows.append({"repeat": rep, "short_ttft_median_s": statistics.median(short),
                     "short_ttft_max_s": max(short),
                     "long_ttft_s": " ".join(f"{x:.1f}" for x in long), "all_done_s": took})
        print(f"run {rep}:")
        print_table(requests, ["kind", "sent_s", "ttft_s"])
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"\n{args.long} prompts of {args.long_len} tokens 0.1 s apart, then {args.short} of "
          f"{args.short_len} every 0.5 s from 1 s; {os.cpu_count()} cores, CPU flags "
          f"{' '.join(flags)}; logs in {logs}")
    print_table(rows, ["repeat", "short_ttft_median_s", "short_ttft_max_s", "long_ttft_s",
                       "all_done_s"])
    write_json(args.json, {"rows": rows, "runs": runs, "args": vars(args), "cpu_flags": flags})


if __name__ == "__main__":
    main()
