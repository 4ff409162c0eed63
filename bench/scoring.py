"""Scoring texts, as evaluation harnesses do (a loglikelihood request: the prompt's own
log-probabilities, `echo` with `logprobs` or vLLM's `prompt_logprobs`): prompt tokens scored
per second by the in-process engine at its defaults, against the same prompts prefilled
without them (what the log-probabilities cost: the LM head over every row, the log-softmax)
and against transformers' forward and log-softmax over batches of them.

    python bench/scoring.py [--num-prompts 32] [--min-len 256] [--max-len 512] [--top 5]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import hf_default_model, print_table, random_prompts, write_json  # noqa: E402
import torch  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def run_pacer(engine: LLMEngine, prompts, top: int | None) -> dict:
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top)
    t = time.perf_counter()
    results = engine.generate(prompts, [sp] * len(prompts))
    elapsed = time.perf_counter() - t
    scored = sum(len(r.prompt_logprobs) for r in results)
    return {"engine": "pacer", "prompt_logprobs": "none" if top is None else f"top {top}",
            "seconds": elapsed, "prompt_tok_s": sum(map(len, prompts)) / elapsed,
            "scored": scored}


def run_hf(prompts, dtype: str, batch_size: int) -> dict:
    model = hf_default_model(dtype)
    pad, scored = 2, 0
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([p + [pad] * (width - len(p)) for p in batch])   # right padding
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
            logprobs = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), -1)
            chosen = logprobs[:, :-1].gather(2, ids[:, 1:, None])[..., 0] * mask[:, 1:]
            scored += int(mask[:, 1:].sum())
            del chosen
    elapsed = time.perf_counter() - t
    return {"engine": f"transformers (batch {batch_size})", "prompt_logprobs": dtype,
            "seconds": elapsed, "prompt_tok_s": sum(map(len, prompts)) / elapsed,
            "scored": scored}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--top", type=int, default=5, help="top log-probabilities asked for")
    ap.add_argument("--hf-dtypes", default="bfloat16,float32")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    engine = LLMEngine(EngineArgs(), progress=False)
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len,
                             engine.tokenizer.vocab_size, seed=1)
    engine.generate(prompts[:2], [SamplingParams(max_tokens=1, prompt_logprobs=0)] * 2)  # warm
    rows = [run_pacer(engine, prompts, top) for top in (None, 0, args.top)]
    rows += [run_hf(prompts, dtype, args.hf_batch_size) for dtype in args.hf_dtypes.split(",")]
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"})
    print(f"{len(prompts)} prompts of {args.min_len}-{args.max_len} random tokens "
          f"({sum(map(len, prompts))} in all), one new token each; default model, engine "
          f"defaults ({engine.args.dtype}, {engine.args.quantization}); "
          f"{torch.get_num_threads()} threads, CPU flags {' '.join(flags)}")
    print_table(rows, ["engine", "prompt_logprobs", "seconds", "prompt_tok_s", "scored"])
    plain, scoring = rows[0], rows[2]
    peer = max(rows[3:], key=lambda r: r["prompt_tok_s"])      # transformers at its best
    print(f"scoring costs {plain['prompt_tok_s'] / scoring['prompt_tok_s']:.2f}x the plain "
          f"prefill; pacer scores {scoring['prompt_tok_s'] / peer['prompt_tok_s']:.2f}x "
          f"transformers' tokens/s ({peer['prompt_logprobs']})")
    write_json(args.json, {"rows": rows, "cpu_flags": flags})


if __name__ == "__main__":
    main()
