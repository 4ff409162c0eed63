"""An iteration with prompt rows in one C++ call against the layers one by one
(docs/design.md#one-call-per-decode-step): the same forward, captured from the in-process
engine at the served defaults, timed both ways in alternation (the logits are the same bits:
tests/test_decoder_stack.py).

Two sweeps, each beside --decodes decode streams:
- fresh: a prompt of n rows, whole in one iteration (n from --fresh);
- prefix: one long prompt (--long-len) chunked --chunk rows at a time, timed at a few points as
  its cached prefix grows (the shape the token-gap target gives while a long prompt arrives).

    python bench/mixed_call.py [--decodes 6] [--fresh 2,16,64,128,512] [--chunk 22]
        [--long-len 1500] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import print_table, random_prompts, write_json  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def timed_both_ways(model, captured, rounds: int = 2, calls: int = 3) -> tuple[float, float]:
    """Best-of-rounds median ms of the captured forward: one call, then layer by layer."""
    ids, kv, meta, backend = captured
    forward, best = model.forward, {True: [], False: []}
    try:
        for _ in range(rounds):
            for native in (True, False):
                model.native_decode = native
                times = []
                for _ in range(calls):
                    t = time.perf_counter()
                    forward(ids, kv, meta, backend)
                    times.append(time.perf_counter() - t)
                best[native].append(statistics.median(times) * 1e3)
    finally:
        model.native_decode = True
    return min(best[True]), min(best[False])


class Capture:
    """Wraps the model's forward; keeps the last call's arguments."""

    def __init__(self, model) -> None:
        self.model, self.forward, self.last = model, model.forward, None

    def __enter__(self):
        def capture(ids, kv, meta, backend, **hooks):
            self.last = (ids, kv, meta, backend)
            return self.forward(ids, kv, meta, backend, **hooks)
        self.model.forward = capture
        return self

    def __exit__(self, *exc) -> None:
        self.model.forward = self.forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, default=6)
    ap.add_argument("--fresh", default="2,16,64,128,512")
    ap.add_argument("--chunk", type=int, default=22)
    ap.add_argument("--long-len", type=int, default=1500)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from services.engine import LLMEngine

    rows = []
    stream = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    once = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # fresh prompts, whole: a token budget that holds the largest beside the decodes
    fresh = [int(n) for n in args.fresh.split(",")]
    budget = max(fresh) + args.decodes
    with LLMEngine(EngineArgs.serving(target_tbt_ms="off", max_num_batched_tokens=budget),
                   progress=False) as engine:
        vocab = engine.model_config.vocab_size
        model = engine.runner.model
        for p in random_prompts(args.decodes, 30, 30, vocab, 1):
            engine.add_request(p, stream)
        for _ in range(4):
            engine.step()
        for i, n in enumerate(fresh):
            engine.add_request(random_prompts(1, n, n, vocab, 10 + i)[0], once)
            with Capture(model) as cap:
                engine.step()
            one, layered = timed_both_ways(model, cap.last)
            rows.append({"sweep": "fresh", "rows": int(cap.last[0].shape[0]), "prompt_rows": n,
                         "kv_len": n, "one_call_ms": one, "layered_ms": layered})
            print(rows[-1], flush=True)
            engine.step()                   # its second token: the prompt leaves
        # one long prompt, args.chunk rows an iteration beside the decodes
    with LLMEngine(EngineArgs.serving(target_tbt_ms="off",
                                      max_num_batched_tokens=args.chunk + args.decodes),
                   progress=False) as engine:
        model = engine.runner.model
        for p in random_prompts(args.decodes, 30, 30, vocab, 2):
            engine.add_request(p, stream)
        for _ in range(4):
            engine.step()
        engine.add_request(random_prompts(1, args.long_len, args.long_len, vocab, 3)[0], once)
        iterations = args.long_len // args.chunk
        every = max(1, iterations // 4)     # four timed points along the prompt
        for it in range(iterations):
            with Capture(model) as cap:
                engine.step()
            if it % every == every - 1:
                one, layered = timed_both_ways(model, cap.last)
                rows.append({"sweep": "prefix", "rows": int(cap.last[0].shape[0]),
                             "prompt_rows": args.chunk, "kv_len": int(cap.last[2].max_seqlen_k),
                             "one_call_ms": one, "layered_ms": layered})
                print(rows[-1], flush=True)
    for row in rows:
        row["layered_over_one_call"] = row["layered_ms"] / row["one_call_ms"]
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"})
    print(f"{args.decodes} decodes beside each; {os.cpu_count()} cores, CPU flags "
          f"{' '.join(flags)}")
    print_table(rows, ["sweep", "rows", "prompt_rows", "kv_len", "one_call_ms", "layered_ms",
                       "layered_over_one_call"])
    write_json(args.json, {"rows": rows, "args": vars(args), "cpu_flags": flags})


if __name__ == "__main__":
    main()
