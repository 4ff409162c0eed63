"""Offline throughput: this engine against transformers `generate` on the same prompts.

64 prompts of random tokens with lengths in [32, 512], 64 new tokens each (EOS ignored so
both sides generate the same count), greedy, the default model. Prints output tokens/s for
each engine and dtype, the ratio, where one iteration's time goes, and the decode floor
memory bandwidth sets.

    python bench/offline_throughput.py [--dtypes bfloat16,float32] [--hf-dtypes bfloat16,float32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (hf_default_model, measure_bandwidth_gbs, print_table,  # noqa: E402
                          random_prompts, write_json)
import torch  # noqa: E402
from gpu_worker.host_memory import model_bytes  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from shared.config import DEFAULT_OFFLINE_MAX_NUM_BATCHED_TOKENS  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def run_ours(prompts, new_tokens, dtype, budget, max_seqs, quantization="auto") -> dict:
    engine = LLMEngine(EngineArgs(dtype=dtype, max_num_batched_tokens=budget,
                                  max_num_seqs=max_seqs, quantization=quantization),
                       progress=False)
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:4], [SamplingParams(max_tokens=4, temperature=0.0)] * 4)  # warm-up
    t = time.perf_counter()
    results = engine.generate(prompts, [sp] * len(prompts))
    elapsed = time.perf_counter() - t
    n = sum(len(r.token_ids) for r in results)
    return {"engine": "pacer", "dtype": dtype, "quantization": quantization, "seconds": elapsed,
            "output_tokens": n, "tok_s": n / elapsed, "_engine": engine}


def run_hf(prompts, new_tokens, dtype, batch_size) -> dict:
    model = hf_default_model(dtype)
    pad = 2
    t = time.perf_counter()
    n = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])    # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                                 top_p=None, top_k=None, temperature=None)
            n += (out.shape[1] - width) * len(batch)
    elapsed = time.perf_counter() - t
    return {"engine": f"transformers (batch {batch_size})", "dtype": dtype, "quantization": "none",
            "seconds": elapsed, "output_tokens": n, "tok_s": n / elapsed}


def profile_iterations(engine: LLMEngine, prompts, new_tokens: int, iterations: int = 8) -> dict:
    """Fill the engine with decoding requests, then profile a few pure-decode iterations."""
    from torch.profiler import ProfilerActivity, profile
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, sp)
    while True:                         # until every request is decoding
        plan = engine.scheduler.schedule()
        engine.scheduler.update(plan, engine.runner.execute(plan))
        if engine.scheduler.num_waiting == 0 and plan.total_tokens == len(plan.num_scheduled_tokens):
            break
    batch = engine.scheduler.num_running
    context = sum(len(s.token_ids) for s in engine.runner.requests.values()) / max(1, batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(iterations):
            engine.step()
        wall = (time.perf_counter() - t) / iterations * 1e3
    for r in list(engine.runner.requests):
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    ev = {e.key: e for e in prof.key_averages()}

    def total(name):   # inclusive CPU time of a record_function scope, ms per iteration
        return ev[name].cpu_time_total / 1e3 / iterations if name in ev else 0.0

    def self_ms(names):
        return sum(ev[n].self_cpu_time_total for n in names if n in ev) / 1e3 / iterations

    # the decoder layers in one native call ("layers": GEMMs and attention together, no finer
    # split seen by the profiler), or layer by layer (torch's GEMMs and the attention scope)
    layers = total("layers")
    attention = total("attention")
    head = total("lm_head") + total("sampling")
    linears = 0.0 if layers else self_ms(["aten::mm", "aten::addmm", "aten::bmm",
                                          "mkldnn::_linear_pointwise"]) - total("lm_head")
    other = wall - layers - attention - head - linears
    return {"batch": batch, "mean_context": context, "iteration_ms": wall,
            "layers_in_one_call_ms": layers, "linears_ms": linears, "attention_ms": attention,
            "lm_head_and_sampling_ms": head, "python_and_other_ms": other}


def decode_floor(engine: LLMEngine, batch: int, context: float, bandwidth_gbs: float) -> dict:
    weights = model_bytes(engine.runner.model)
    k0 = engine.runner.kv_caches[0][0]
    kv_per_token = 2 * len(engine.runner.kv_caches) * k0.shape[2] * k0.shape[3] * k0.element_size()
    kv = kv_per_token * batch * context
    ms = (weights + kv) / (bandwidth_gbs * 1e9) * 1e3
    return {"weight_bytes": weights, "kv_bytes": int(kv), "bandwidth_gbs": bandwidth_gbs,
            "floor_ms": ms, "floor_tok_s": batch / ms * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--hf-dtypes", default="bfloat16,float32")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int,
                    default=DEFAULT_OFFLINE_MAX_NUM_BATCHED_TOKENS, help="as pacer generate")
    ap.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs)
    ap.add_argument("--quantization", default="auto",
                    help="as pacer up, for every pacer run (auto: the GGUF's int4 by default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, 49152, seed=0,
                             avoid=tuple(range(17)))
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
          f"{args.new_tokens} new tokens each, torch threads {torch.get_num_threads()}")
    rows = []
    for dt in filter(None, args.dtypes.split(",")):
        rows.append(run_ours(prompts, args.new_tokens, dt, args.max_num_batched_tokens,
                             args.max_num_seqs, args.quantization))
        print(f"  pacer {dt}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    for dt in filter(None, args.hf_dtypes.split(",")):
        rows.append(run_hf(prompts, args.new_tokens, dt, args.hf_batch_size))
        print(f"  transformers {dt}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    print()
    print_table(rows, ["engine", "dtype", "quantization", "seconds", "output_tokens", "tok_s"])
    ours = max((r for r in rows if r["engine"] == "pacer"), key=lambda r: r["tok_s"], default=None)
    hf = max((r for r in rows if r["engine"] != "pacer"), key=lambda r: r["tok_s"], default=None)
    report = {"rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}
    if ours and hf:
        report["ratio"] = ours["tok_s"] / hf["tok_s"]
        print(f"\npacer {ours['dtype']} / transformers {hf['dtype']} (each's faster dtype): "
              f"{report['ratio']:.2f}x")
    if ours:
        engine = ours["_engine"]
        prof = profile_iterations(engine, prompts, args.new_tokens)
        floor = decode_floor(engine, prof["batch"], prof["mean_context"], measure_bandwidth_gbs())
        report.update(profile=prof, decode_floor=floor)
        print(f"\nwhere a decode iteration goes (pacer {ours['dtype']}, batch {prof['batch']}, "
              f"mean context {prof['mean_context']:.0f}):")
        for k in ("iteration_ms", "layers_in_one_call_ms", "linears_ms", "attention_ms",
                  "lm_head_and_sampling_ms", "python_and_other_ms"):
            print(f"  {k:26s} {prof[k]:8.1f}")
        print(f"decode floor: ({floor['weight_bytes'] / 1e6:.0f} MB weights + "
              f"{floor['kv_bytes'] / 1e6:.0f} MB KV) / {floor['bandwidth_gbs']:.1f} GB/s = "
              f"{floor['floor_ms']:.1f} ms/iteration = {floor['floor_tok_s']:.0f} tok/s; measured "
              f"{prof['iteration_ms']:.1f} ms ({floor['floor_ms'] / prof['iteration_ms']:.0%} of the floor's speed)")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
