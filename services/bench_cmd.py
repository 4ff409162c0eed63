"""`pacer bench`: the serving benchmark client (vLLM's `bench serve` method) against any
OpenAI-compatible server.

    pacer bench --base-url http://127.0.0.1:8000 --dataset random --input-len 128 \
        --output-len 64 --num-prompts 64 --max-concurrency 32 --result-json out.json

Datasets (services/bench_dataset.py): random, sharegpt-like, shared-prefix (`--num-prefixes`
system prompts of `--prefix-len` tokens), multi-turn (`--num-conversations`, each turn resending
the history). Prompts are generated from `--seed` with the model's tokenizer (`--tokenizer`); arrivals are
Gamma(shape=burstiness, scale=1/(rate·burstiness)); every latency is measured at the client
(definitions in services/bench_client.py). Failed requests are counted and summed up in
one line on stderr; the run exits 0 if any request succeeded (vLLM's `bench serve` exits 0
either way), 1 with that line as its error if none did, and 130 on Ctrl-C, reporting the
requests that ended.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from shared.errors import PacerError
from shared.json_file import check_output_path

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# The most prompts a run may send: hours of any server's time. 10**11 (a typo) was a
# MemoryError traceback drawing their lengths.
MAX_PROMPTS = 10**6

WIDTH = 50
LATENCIES = (("ttft", "Time to First Token", "TTFT"),
             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"),
             ("e2el", "End-to-end Latency", "E2EL"))


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a running server the way vLLM's `bench serve` does")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--model", default=None,
                   help="the served model name sent as `model` (default: ask /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="model spec whose tokenizer makes the prompts (default: smollm2-135m)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset", default="random",
                   choices=["random", "sharegpt-like", "shared-prefix", "multi-turn"])
    p.add_argument("--input-len", type=int, default=128,
                   help="random: prompt tokens; shared-prefix: the user turn after the shared "
                        "prefix; multi-turn: each user turn")
    p.add_argument("--output-len", type=int, default=64,
                   help="random, shared-prefix: output tokens; multi-turn: each reply")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len·(1-r), len·(1+r)]")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt-like: fix every output length instead of drawing it")
    p.add_argument("--num-prefixes", type=int, default=8,
                   help="shared-prefix: distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=1024,
                   help="shared-prefix: tokens of each system prompt")
    p.add_argument("--num-conversations", type=int, default=8,
                   help="multi-turn: conversations the --num-prompts turns are spread over")
    p.add_argument("--prompt-format", default="text", choices=["text", "ids"],
                   help="send prompts as text or as token ids (completions only)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the arrival gaps: 1 is Poisson, smaller is burstier")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the drawn output lengths (default on)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="more fields of every request, e.g. '{\"structured_outputs\": "
                        "{\"regex\": \"[a-z ]+\"}}' (with --no-ignore-eos)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:200 (names: ttft, tpot, e2el)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds one request may take from send to the end of its stream")
    p.add_argument("--result-json", default=None,
                   help="also write the metrics as JSON to this file (default: only printed)")
    p.add_argument("--save-detailed", action="store_true",
                   help="also write every request's timeline into the JSON")
    p.set_defaults(run=run)


# ---- workload ----------------------------------------------------------------------------

def build_requests(args: argparse.Namespace) -> list:
    from services.bench_dataset import (multi_turn_dataset, random_dataset,
                                        shared_prefix_dataset, sharegpt_like_dataset)
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    as_ids = args.prompt_format == "ids"
    if as_ids and args.endpoint != "/v1/completions":
        raise PacerError("--prompt-format ids needs --endpoint /v1/completions")
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        raise PacerError(f"--num-prompts must be from 1 to {MAX_PROMPTS:,}, got {args.num_prompts:,}")
    tokenizer = load_tokenizer(resolve_model(args.tokenizer))
    if args.dataset != "sharegpt-like" and (args.input_len < 1 or args.output_len < 1):
        raise PacerError("--input-len and --output-len must be >= 1")
    try:
        if args.dataset == "random":
            return random_dataset(tokenizer, args.num_prompts, args.input_len, args.output_len,
                                  args.range_ratio, args.seed, as_ids)
        if args.dataset == "shared-prefix":
            return shared_prefix_dataset(tokenizer, args.num_prompts, args.num_prefixes,
                                         args.prefix_len, args.input_len, args.output_len,
                                         args.range_ratio, args.seed, as_ids)
        if args.dataset == "multi-turn":
            return multi_turn_dataset(tokenizer, args.num_prompts, args.num_conversations,
                                      args.input_len, args.output_len, args.range_ratio,
                                      args.seed, as_ids)
    except ValueError as e:
        raise PacerError(f"--dataset {args.dataset}: {e}") from e
    return sharegpt_like_dataset(tokenizer, args.num_prompts, args.seed,
                                 args.sharegpt_output_len, as_ids)


def served_model_name(base_url: str, api_key: str | None) -> str:
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=10.0) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        if isinstance(e, urllib.error.HTTPError) and e.code in (401, 403):
            # --model would not help: every request would be refused the same way
            problem = "refused the API key" if api_key else "wants an API key"
            raise PacerError(f"{base_url} {problem} (HTTP {e.code}): pass the server's key "
                             f"with --api-key or $OPENAI_API_KEY") from e
        if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
            # nothing answers there: --model would not help, every request would fail too
            raise PacerError(f"cannot reach {base_url} ({e.reason}): is the server running, "
                             "and is --base-url its address?") from e
        raise PacerError(f"cannot read the model name from {base_url}/v1/models ({e}); "
                         "pass --model") from e


PREFIX_CACHE_COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total")


def prefix_cache_counters(base_url: str) -> dict[str, float] | None:
    """The server's prefix cache counters from its /metrics (pacer's or vLLM's names, summed
    over labels), or None where it has none or /metrics does not answer."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10.0) as r:
            text = r.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return None
    return parse_prefix_cache_counters(text)


def parse_prefix_cache_counters(text: str) -> dict[str, float] | None:
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        metric = name.split("{", 1)[0].split(":", 1)[-1]
        if metric in PREFIX_CACHE_COUNTERS:
            try:
                found[metric] = found.get(metric, 0.0) + float(value)
            except ValueError:
                continue
    return found if len(found) == len(PREFIX_CACHE_COUNTERS) else None


def prefix_cache_hit_rate(before: dict[str, float] | None,
                          after: dict[str, float] | None) -> float | None:
    """Percent of the prompt tokens looked up during the run that were cached."""
    if before is None or after is None:
        return None
    queries = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    return 100.0 * hits / queries if queries > 0 else None


# ---- report ------------------------------------------------------------------------------

def format_table(metrics: dict, title: str = "Serving Benchmark Result") -> str:
    """The metrics as vLLM prints them: one line per figure, a section per latency."""
    lines = [f" {title} ".center(WIDTH, "=")]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if metrics.get("unfinished"):
        row("Unfinished requests (Ctrl-C):", metrics["unfinished"])
    if metrics.get("max_concurrency") is not None:
        row("Maximum request concurrency:", metrics["max_concurrency"])
    row("Benchmark duration (s):", metrics["duration_s"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    if "request_goodput" in metrics:
        row("Request goodput (req/s):", metrics["request_goodput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    if metrics.get("prefix_cache_hit_rate") is not None:
        row("Prefix cache hit rate (%):", metrics["prefix_cache_hit_rate"])
    for key, heading, short in LATENCIES:
        if f"mean_{key}_ms" not in metrics:
            continue
        lines.append(f"{heading}".center(WIDTH, "-"))
        row(f"Mean {short} (ms):", metrics[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", metrics[f"median_{key}_ms"])
        row(f"P99 {short} (ms):", metrics[f"p99_{key}_ms"])
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _json_safe(value):
    """JSON has no NaN or Infinity: unknown figures are written as null, an infinite
    request rate as "inf"."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def write_result_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_safe(data), f, indent=2)


# ---- run ---------------------------------------------------------------------------------

def run_async(coro):
    """uvloop when installed: the client must not be the bottleneck on a 2-core machine
    (a loop factory, so the process-wide policy stays as it was)."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def run(args: argparse.Namespace) -> int:
    from services.bench_client import (ApiTarget, RequestResult, SendOptions, compute_metrics,
                                       error_summary, parse_goodput, result_records,
                                       run_requests)

    try:
        slos = parse_goodput(args.goodput or [])
    except ValueError as e:
        raise PacerError(f"--goodput: {e}") from e
    if not args.request_timeout > 0:
        raise PacerError(f"--request-timeout must be > 0 seconds, got {args.request_timeout:g}")
    url = urllib.parse.urlsplit(args.base_url)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise PacerError(f"--base-url must be an http:// or https:// URL, got {args.base_url!r}")
    if args.result_json:
        check_output_path(args.result_json, "--result-json")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise PacerError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not (args.request_rate > 0 and 0 < args.burstiness < math.inf):     # NaN fails both
        raise PacerError(f"--request-rate must be > 0 (inf: all at once) and --burstiness a "
                         f"finite number > 0; got {args.request_rate:g} and "
                         f"{args.burstiness:g}")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
        raise PacerError(f"--sharegpt-output-len must be >= 1, got {args.sharegpt_output_len}")
    requests = build_requests(args)
    model = args.model or served_model_name(args.base_url, args.api_key)
    target = ApiTarget(args.base_url, args.endpoint, model, args.api_key)
    opts = SendOptions(args.temperature, args.ignore_eos, args.request_timeout,
                       extra_body=args.extra_body)
    print(f"pacer bench: {len(requests)} {args.dataset} prompts to {target.url} "
          f"(rate {args.request_rate:g}/s, burstiness {args.burstiness:g}, "
          f"max concurrency {args.max_concurrency or 'none'})", file=sys.stderr, flush=True)
    cache_before = prefix_cache_counters(args.base_url)
    ended: list[tuple[float, RequestResult]] = []      # (when, result), as requests end
    start = time.perf_counter()
    try:
        results, duration = run_async(run_requests(
            target, requests, opts, args.request_rate, args.burstiness, args.max_concurrency,
            args.seed, on_done=lambda r: ended.append((time.perf_counter(), r))))
        unfinished = 0
    except KeyboardInterrupt:
        # Ctrl-C: the requests that ended are reported as a run that stopped at the last of
        # them; those in flight (cancelled) or not yet sent are counted, not measured
        results = sorted((r for _, r in ended), key=lambda r: r.sent_at)
        duration = (ended[-1][0] if ended else time.perf_counter()) - start
        unfinished = len(requests) - len(results)
        print(f"pacer bench: interrupted (Ctrl-C): the metrics below are of the "
              f"{len(results)} requests that ended; {unfinished} were in flight or not sent",
              file=sys.stderr, flush=True)
    metrics = compute_metrics(results, duration, slos)
    metrics["max_concurrency"] = args.max_concurrency
    if unfinished:
        metrics["unfinished"] = unfinished
    metrics["prefix_cache_hit_rate"] = prefix_cache_hit_rate(
        cache_before, prefix_cache_counters(args.base_url) if cache_before else None)
    print(format_table(metrics))
    for message, count in error_summary(results):
        print(f"failed x{count}: {message}")
    if args.result_json:
        config = {k: v for k, v in vars(args).items() if k not in ("run", "api_key")}
        data = {"config": config, "model": model, **metrics, "goodput_slos_ms": slos,
                "errors": error_summary(results, limit=20)}
        if args.save_detailed:
            data["requests"] = result_records(results)
        write_result_json(args.result_json, data)
        print(f"pacer bench: metrics written to {args.result_json}", file=sys.stderr)
    if unfinished:
        return 130
    if metrics["failed"]:
        (message, count), *others = error_summary(results, limit=len(results))
        share = f"{metrics['failed']} of {len(results)}" if metrics["completed"] else \
            f"all {len(results)}"
        what = (f"{share} requests failed ({count} with "
                f"{message}" + (f"; {len(others)} other errors, listed above)" if others else ")"))
        if not metrics["completed"]:
            # nothing was measured: a script driving the run must not read its zeros as figures
            raise PacerError(f"{what}: nothing was measured")
        print(f"pacer bench: {what}: the metrics are of the {metrics['completed']} that "
              "succeeded", file=sys.stderr)
    return 0
