"""Quantized weights, measured: pacer int4 / int8 / float beside llama.cpp on the same GGUF.

Speed (served, `pacer bench`'s client, bench/peers.py's workloads: random ~106-token prompts,
64 greedy tokens, EOS ignored): one stream (8 prompts one at a time) and 32 concurrent
(64 prompts); the worker's resident memory once warm (llama-server's for llama.cpp).

Accuracy (in process): greedy agreement with the float32 reference (`--dtype float32
--quantization none`: the GGUF dequantized, which is what transformers computes) over the
parity prompts of tests/test_engine_parity.py — tokens until the first divergence and the share
of identical completions — and perplexity on a fixed text (docs/design.md), scored as
llama.cpp's `llama-perplexity` scores it: windows of --ppl-ctx tokens, the second half of each
predicted from everything before it. llama.cpp's rows come from its server (greedy) and its
`llama-perplexity` (built beside `llama-server` by `--setup`).

    python bench/quantized.py --setup                  # build llama-server + llama-perplexity
    python bench/quantized.py [--engines pacer-int4,pacer-int8,pacer-float,pacer-float32,llamacpp]
                              [--skip-speed] [--skip-accuracy] [--json docs/quantized.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import descendants, print_table, write_json  # noqa: E402
from bench.peers import (CACHE, SHOWN_FLAGS, free_port, llama_server, log,  # noqa: E402
                         run_workload, setup_llama_server, stop, wait_ready)
from bench.peers import server_command as peers_server_command  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402

LLAMA_PERPLEXITY = os.path.join(os.path.dirname(llama_server("native")), "llama-perplexity")
TEXT = os.path.join(ROOT, "docs", "design.md")
# pacer engine name -> its flags (the model: the default GGUF, Q4_1 with a Q8_0 embedding)
PACER = {"pacer-int4": ["--quantization", "int4"],
         "pacer-int8": ["--quantization", "int8"],
         "pacer-float": ["--quantization", "none"],         # --dtype auto: this CPU's best float
         "pacer-float32": ["--quantization", "none", "--dtype", "float32"]}


def setup() -> None:
    setup_llama_server()
    if not os.path.exists(LLAMA_PERPLEXITY):
        build = os.path.join(CACHE, "llama.cpp", "build")
        subprocess.run(["cmake", "--build", build, "--target", "llama-perplexity", "-j",
                        str(os.cpu_count() or 2)], check=True)


# ---- speed and memory ---------------------------------------------------------------------

def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def worker_pid(root: int) -> int:
    """`pacer up`'s worker rank 0 (the process that holds the weights)."""
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"worker" in argv:
            return pid
    raise RuntimeError("no worker process under pacer up")


def server_command(engine: str, port: int) -> list[str]:
    if engine in PACER:
        return [sys.executable, "-m", "services.cli", "up", "--port", str(port),
                "--redis-url", f"redis://127.0.0.1:{free_port()}/0", *PACER[engine]]
    return peers_server_command("llamacpp", "q4_1", port)[0]      # as bench/peers.py runs it


def start_server(engine: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log_path = os.path.join(CACHE, f"quantized-{engine}.log")
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(server_command(engine, port), cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log_path)
    except BaseException:
        stop(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


def measure_speed(engine: str) -> dict:
    proc, base_url = start_server(engine)
    try:
        result = {name: run_workload(base_url, name, seed) for name, seed in (("c32", 0),
                                                                              ("c1", 1))}
        holder = worker_pid(proc.pid) if engine in PACER else proc.pid
        return {"engine": engine, "c1_tok_s": result["c1"]["tok_s"],
                "c1_itl_ms": result["c1"]["median_itl_ms"], "c32_tok_s": result["c32"]["tok_s"],
                "c32_ttft_ms": result["c32"]["median_ttft_ms"], "rss_mib": rss_mib(holder)}
    finally:
        stop(proc)


def single_stream_rounds(engines: list[str], rounds: int) -> list[dict]:
    """Every engine's server up at once, one stream at a time, engines taking turns for
    `rounds` rounds: on a shared machine, each round meets the same load."""
    from services.bench_client import ApiTarget, SendOptions, compute_metrics, run_requests
    from services.bench_cmd import run_async
    from services.bench_dataset import random_dataset
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    reqs = random_dataset(load_tokenizer(resolve_model(None)), 8, 106, 64, 0.0, seed=1)
    servers = {e: start_server(e) for e in engines}
    rows = []
    try:
        targets = {e: ApiTarget(url, "/v1/completions", "smollm2-135m", None)
                   for e, (_, url) in servers.items()}
        opts = SendOptions(0.0, True, 600.0)
        for e in engines:                                                   # warm-up
            run_async(run_requests(targets[e], reqs[:2], opts, max_concurrency=1))
        for r in range(rounds):
            for e in engines:
                results, duration = run_async(run_requests(targets[e], reqs, opts,
                                                           max_concurrency=1))
                m = compute_metrics(results, duration)
                rows.append({"round": r, "engine": e, "c1_tok_s": m["output_throughput"],
                             "c1_itl_ms": m.get("median_itl_ms"), "failed": m["failed"]})
                log(f"round {r} {e}: {m['output_throughput']:.1f} tok/s")
    finally:
        for proc, _ in servers.values():
            stop(proc)
    return rows


# ---- accuracy -----------------------------------------------------------------------------

def parity_prompts(tok) -> list[list[int]]:
    from tests.hf_reference import CHAT_PROMPTS
    return [tok.encode_chat([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]


def pacer_engine(quantization: str, dtype: str):
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    return LLMEngine(EngineArgs(quantization=quantization, dtype=dtype, num_kv_blocks=512,
                                max_num_batched_tokens=1024), progress=False)


def greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from shared.sampling import SamplingParams
    out = engine.generate(prompts, [SamplingParams(max_tokens=tokens, temperature=0.0,
                                                   ignore_eos=True)] * len(prompts))
    return [c.token_ids for c in out]


def perplexity(engine, ids: list[int], ctx: int) -> float:
    """llama-perplexity's score: each window of `ctx` tokens, nll of its second half."""
    import math

    import torch

    from gpu_worker.attention import Chunk, build_attention_metadata
    runner = engine.runner
    model, bs = runner.model, runner.rc.block_size
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - ctx + 1, ctx):
            window = ids[start:start + ctx]
            meta = build_attention_metadata([Chunk(ctx, ctx, list(range(-(-ctx // bs))))], bs,
                                            "cpu", runner.act_dtype)
            meta.sample_rows = torch.arange(ctx)                  # every row's logits
            logits = model(torch.tensor(window), runner.kv_caches, meta, runner.backend)
            logp = torch.log_softmax(logits.float(), dim=-1)
            first = ctx // 2
            targets = torch.tensor(window[first + 1:])
            nll -= float(logp[first:ctx - 1].gather(1, targets.unsqueeze(1)).sum())
            count += len(targets)
    return math.exp(nll / count)


def llamacpp_greedy(prompts: list[list[int]], tokens: int) -> list[list[int]]:
    port = free_port()
    log_path = os.path.join(CACHE, "quantized-llamacpp-greedy.log")
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(server_command("llamacpp", port), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, log_path)
        outs = []
        for p in prompts:
            body = {"prompt": p, "n_predict": tokens, "temperature": 0.0, "top_k": 1,
                    "ignore_eos": True, "return_tokens": True, "cache_prompt": False}
            req = urllib.request.Request(base + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                outs.append(json.load(r)["tokens"])
        return outs
    finally:
        stop(proc)


def llamacpp_perplexity(ctx: int, chunks: int) -> float | None:
    if not os.path.exists(LLAMA_PERPLEXITY):
        log("llama-perplexity not built (python bench/quantized.py --setup)")
        return None
    from shared.model_source import resolve_model
    out = subprocess.run([LLAMA_PERPLEXITY, "-m", resolve_model(None).path, "-f", TEXT, "-c",
                          str(ctx), "--chunks", str(chunks), "-t", str(os.cpu_count() or 2),
                          "-b", str(ctx)], capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    return float(m.group(1)) if m else None


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    firsts = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r))
              for o, r in zip(ours, ref)]
    return {"identical": f"{sum(o == r for o, r in zip(ours, ref))}/{len(ref)}",
            "mean_tokens_to_divergence": sum(firsts) / len(firsts),
            "min_tokens_to_divergence": min(firsts)}


def measure_accuracy(engines: list[str], tokens: int, ctx: int) -> list[dict]:
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model(None))
    prompts = parity_prompts(tok)
    with open(TEXT, encoding="utf-8") as f:
        text_ids = tok.encode(f.read())
    chunks = len(text_ids) // ctx
    rows, ref = [], None
    for name, quant in (("float32 (reference)", "none"), ("pacer-int8", "int8"),
                        ("pacer-int4", "int4")):
        if name != "float32 (reference)" and name not in engines:
            continue
        engine = pacer_engine(quant, "float32")
        outs = greedy(engine, prompts, tokens)
        ref = ref or outs
        rows.append({"engine": name, **agreement(outs, ref),
                     "ppl": perplexity(engine, text_ids, ctx)})
        log(f"accuracy {name}: {rows[-1]}")
        del engine
    if "llamacpp" in engines:
        outs = llamacpp_greedy(prompts, tokens)
        rows.append({"engine": "llamacpp (Q4_1 as shipped)", **agreement(outs, ref),
                     "ppl": llamacpp_perplexity(ctx, chunks)})
        log(f"accuracy llamacpp: {rows[-1]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setup", action="store_true")
    ap.add_argument("--engines", default="pacer-int4,pacer-int8,pacer-float,pacer-float32,llamacpp")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--single-stream-rounds", type=int, default=0,
                    help="instead of the speed table: one stream only, every engine up at "
                         "once, taking turns for this many rounds")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per parity prompt")
    ap.add_argument("--ppl-ctx", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(CACHE, exist_ok=True)
    if args.setup:
        setup()
        return
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    flags = cpu_flags()
    shown = " ".join(f for f in SHOWN_FLAGS if f in flags)
    speed, accuracy, rounds = [], [], []
    if args.single_stream_rounds:
        rounds = single_stream_rounds(engines, args.single_stream_rounds)
    elif not args.skip_speed:
        for engine in engines:
            started = time.monotonic()
            try:
                speed.append(measure_speed(engine))
            except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
                log(f"{engine}: {e}")
                continue
            log(f"{engine}: {speed[-1]} ({time.monotonic() - started:.0f} s)")
    if not args.skip_accuracy:
        accuracy = measure_accuracy(engines, args.tokens, args.ppl_ctx)
    print(f"CPU flags: {shown}; cores: {os.cpu_count()}")
    if speed:
        print_table(speed, ["engine", "c1_tok_s", "c1_itl_ms", "c32_tok_s", "c32_ttft_ms",
                            "rss_mib"])
    if rounds:
        print_table(rounds, ["round", "engine", "c1_tok_s", "c1_itl_ms", "failed"])
    if accuracy:
        print_table(accuracy, ["engine", "identical", "mean_tokens_to_divergence",
                               "min_tokens_to_divergence", "ppl"])
    write_json(args.json, {"cpu_flags": shown, "speed": speed, "single_stream_rounds": rounds,
                           "accuracy": accuracy})


if __name__ == "__main__":
    main()
