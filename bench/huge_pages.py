"""Weights and KV pool in transparent huge pages against 4 KiB pages, in one process.

Two engines with the same flags, one built with `PACER_HUGE_PAGES=0` (gpu_worker/host_memory.py:
the same mappings without the advice), one with the default; rounds alternate between them,
each a batch of `--batch` fresh random prompts of `--input-len` tokens decoded for
`--output-len` tokens (greedy, EOS ignored). Prints each round's median step time and the
ratio 4 KiB / huge per round, and how much of each engine's memory the kernel backed with huge
pages (/proc/self/smaps of its mappings).

    python bench/huge_pages.py [--batch 1] [--rounds 6] [--json out.json] [engine flags]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import engine_arg_parser, random_prompts, write_json  # noqa: E402
from gpu_worker.host_memory import mapping_fields  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def huge_mib(ptr: int) -> int:
    """MiB of huge pages under the mapping that holds address `ptr`."""
    return int(mapping_fields(ptr).get("AnonHugePages", "0 kB").split()[0]) >> 10


def build(args, huge: bool) -> LLMEngine:
    os.environ["PACER_HUGE_PAGES"] = "1" if huge else "0"
    return LLMEngine(EngineArgs.from_cli(args), progress=False)


def decode_round(engine: LLMEngine, args, seed: int) -> float:
    """Median ms between steps once every request has its first token."""
    cfg = engine.model_config
    prompts = random_prompts(args.batch, args.input_len, args.input_len, cfg.vocab_size,
                             seed=seed, avoid=cfg.eos_token_ids)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    ids = {engine.add_request(p, sp) for p in prompts}
    started: set[str] = set()
    gaps, finished, last = [], 0, None
    while finished < len(ids):
        outs = engine.step()
        now = time.perf_counter()
        if started == ids and last is not None:
            gaps.append(now - last)
        started.update(o.request_id for o in outs)
        finished += sum(1 for o in outs if o.finished)
        last = now
    return statistics.median(gaps) * 1e3


def main() -> None:
    ap = engine_arg_parser(__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=106)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    engines = {"4k": build(args, False), "huge": build(args, True)}
    for name, engine in engines.items():
        runner = engine.runner
        weight = runner.model.layers[0].mlp.down_proj
        w = getattr(weight, "qweight", None)
        w = getattr(w, "vnni", None) if w is not None else weight.weight
        print(f"{name}: huge pages under the weights {huge_mib(w.data_ptr())} MiB, "
              f"under the KV pool {huge_mib(runner.kv_pool.data_ptr())} MiB")
        decode_round(engine, args, seed=1)              # warm
    ms: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for i, (name, engine) in enumerate(engines.items()):
            ms[name].append(decode_round(engine, args, seed=100 + 2 * r + i))
        print(f"round {r + 1}: 4k {ms['4k'][-1]:.2f} ms, huge {ms['huge'][-1]:.2f} ms per step "
              f"({ms['4k'][-1] / ms['huge'][-1]:.3f}x)", flush=True)
    ratios = [a / b for a, b in zip(ms["4k"], ms["huge"])]
    print(f"batch {args.batch}: median step 4k {statistics.median(ms['4k']):.2f} ms, huge "
          f"{statistics.median(ms['huge']):.2f} ms; per-round ratio 4k/huge median "
          f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
    write_json(args.json, {"batch": args.batch, "ms_per_step": ms, "ratios": ratios})
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
