"""What drawing a token costs, by sampling parameters and rows, on the default model's own
logits (docs/benchmarks.md#sampling).

The in-process engine decodes `--rows` requests at temperature 1 for a few steps; the logits of
one decode step are kept, then `Sampler.sample` is timed on them (median of `--repeats`
calls) for greedy, temperature 1 (the OpenAI API's default), temperature 0.7 with top-p 0.9,
top-k 50, a seeded draw, greedy with penalties over a 1k-token history, and greedy under a
JSON schema (the grammar's mask computed and applied first), at 1, 8 and all rows. Real logits matter: the top-k/top-p cost
depends on how much of the vocabulary the nucleus takes, and random logits make it far wider
than a language model's. Also printed: the nucleus sizes (tokens in top-p 0.9) of those logits.

    python bench/sampling.py [--rows 32] [--repeats 30] [--json out.json]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import engine_arg_parser, print_table, random_prompts, write_json  # noqa: E402  (OpenMP policy first)
import torch  # noqa: E402

from gpu_worker.sampler import TokenCounts  # noqa: E402
from gpu_worker.structured import mask_rows  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "t 0.7, top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t 1, top-k 50": SamplingParams(temperature=1.0, top_k=50),
    "t 1, seeded": SamplingParams(temperature=1.0, seed=7),
    # greedy with all three penalties over a history of HISTORY tokens (half of them output),
    # the counts kept between calls as the runner keeps them: a step's cost, one new token
    "greedy, penalties": SamplingParams(temperature=0.0, presence_penalty=0.5,
                                        frequency_penalty=0.5, repetition_penalty=1.1),
    # greedy under a JSON schema, every row inside a string value (the widest mask: almost
    # any token may come next), the grammar's mask computed and applied then the draw
    "greedy, JSON schema": SamplingParams(temperature=0.0, structured_outputs={"json": {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}),
}
HISTORY = 1000
IN_A_STRING = '{"name": "Ada'


def decode_logits(engine: LLMEngine, rows: int, vocab: int) -> torch.Tensor:
    """The [rows, V] logits of one decode step of `rows` requests (after a few steps)."""
    sampler = engine.runner.sampler
    kept: list[torch.Tensor] = []
    original = sampler.sample

    def keep(logits, *rest, **options):
        if logits.shape[0] == rows:
            kept.append(logits.detach().clone())
        return original(logits, *rest, **options)

    sampler.sample = keep
    try:
        for prompt in random_prompts(rows, 20, 40, vocab, seed=3):
            engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=1.0,
                                                      ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    finally:
        sampler.sample = original
    if not kept:
        raise RuntimeError(f"no decode step of {rows} rows was seen")
    return kept[-1].float()


def main() -> None:
    ap = engine_arg_parser(__doc__)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs.from_cli(args), progress=False)
    vocab = engine.runner.model.cfg.vocab_size
    logits = decode_logits(engine, args.rows, vocab)
    sampler = engine.runner.sampler
    probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values.cumsum(dim=-1)
    nucleus = sorted(((probs < 0.9).sum(dim=-1) + 1).tolist())
    rows = []
    for r in sorted({1, min(8, args.rows), args.rows}):
        row = {"rows": r}
        for name, params in CASES.items():
            times = []
            gen = torch.Generator().manual_seed(r)
            counts = [TokenCounts(torch.randint(0, vocab, (HISTORY,), generator=gen).tolist(),
                                  HISTORY // 2) for _ in range(r)]
            matchers = [engine.runner.grammars.matcher(
                str(i), params, engine.tokenizer.encode(IN_A_STRING)) for i in range(r)]
            for k in range(args.repeats):
                for c in counts:
                    c.tokens.append(int(torch.randint(0, vocab, (1,), generator=gen)))
                step_logits = logits[:r].clone()
                start = time.perf_counter()
                masked = matchers[0] is not None
                if masked:
                    mask_rows(step_logits, list(range(r)), matchers, engine.runner.grammars.n_vocab)
                sampler.sample(step_logits, [params] * r, [k] * r, counts, masked=masked)
                times.append((time.perf_counter() - start) * 1e3)
            row[name] = statistics.median(times)
        rows.append(row)
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"Sampler.sample, ms (median of {args.repeats}), on one decode step's logits of the "
          f"default model ({vocab} tokens); {torch.get_num_threads()} threads, CPU flags "
          f"{' '.join(flags)}")
    print_table(rows, ["rows", *CASES])
    print(f"top-p 0.9 nucleus at temperature 1, tokens: median {nucleus[len(nucleus) // 2]}, "
          f"max {nucleus[-1]} (of {len(nucleus)} rows)")
    write_json(args.json, {"rows": rows, "nucleus_sizes": nucleus, "cpu_flags": flags,
                           "args": vars(args)})
    engine.shutdown()


if __name__ == "__main__":
    main()
