"""How the CPU default token budget (`--max-num-batched-tokens`) was chosen: offline
throughput of the offline_throughput workload at several budgets, in one run, rounds
alternating (A, B, C, A, B, C …) on this noisy machine; plus the worst decode gap each budget
gives (a bigger budget packs more prefill beside the decodes, so each gap is longer).

    python bench/budget_sweep.py [--budgets 256,512,1024,2048] [--rounds 2] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import print_table, random_prompts, write_json  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def run(engine: LLMEngine, prompts, new_tokens: int) -> tuple[float, float]:
    """Output tokens/s, and the longest wall-clock gap between two iterations that gave a
    running request a token."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, sp)
    start = last = time.perf_counter()
    n, worst, decoding = 0, 0.0, False
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        if decoding:
            worst = max(worst, now - last)
        n += sum(len(o.new_tokens) for o in outs)
        decoding, last = bool(outs), now
    return n / (time.perf_counter() - start), worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="256,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    prompts = random_prompts(args.num_prompts, 32, 512, 49152, seed=0, avoid=tuple(range(17)))
    engines = {b: LLMEngine(EngineArgs(dtype=args.dtype, max_num_batched_tokens=b), progress=False)
               for b in budgets}
    runs: dict[int, list[tuple[float, float]]] = {b: [] for b in budgets}
    for r in range(args.rounds):
        for b in budgets:
            runs[b].append(run(engines[b], prompts, args.new_tokens))
            print(f"round {r} budget {b}: {runs[b][-1][0]:.1f} tok/s", flush=True)
    rows = [{"budget": b, "tok_s_median": statistics.median(x[0] for x in runs[b]),
             "worst_gap_ms": 1e3 * statistics.median(x[1] for x in runs[b])} for b in budgets]
    print()
    print_table(rows, ["budget", "tok_s_median", "worst_gap_ms"])
    write_json(args.json, {"dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
