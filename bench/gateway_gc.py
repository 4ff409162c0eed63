"""How long a big non-streamed answer with logprobs holds the gateway's event loop, and
what the cyclic garbage collector has to do with it.

    python bench/gateway_gc.py --redis-url redis://127.0.0.1:6379/0 [--port 8001]
        [--model smollm2-135m] [--max-tokens 2000] [--top 20] [--streams 3]
        [--requests 0,1,2,3] [--json out.json]

Against a running `pacer up` (its scheduler and workers) it starts a second gateway on
`--port`, with a probe inside: a task that sleeps 5 ms at a time and notes how much later it
woke (the loop's lag), and a `gc.callbacks` hook that times every collection (the
collector holds the GIL, so the loop waits for all of it, on a thread too). Then, beside
`--streams` greedy streams, it sends one after another: a completion with `logprobs`, `echo`
and `max_tokens` tokens; a chat completion with `top_logprobs`; and a completion with
`n` 4 of a quarter of the tokens each; a chat completion with `n` 4 of half of them. It
prints, per request, the loop's longest lag, the longest collection of each generation and
the streams' longest token gap.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the probe, run in the gateway's process before `pacer gateway`'s own code
PROBE = r"""
import asyncio, gc, json, sys, time
import gateway.app as app
OUT = sys.argv.pop(1)
events = []     # (monotonic end, kind, ms, process CPU ms meanwhile): kind "lag" or "gc0".."gc2"
started = {}

def on_gc(phase, info):
    if phase == "start":
        started["t"], started["cpu"] = time.perf_counter(), time.process_time()
    elif "t" in started:
        ms = (time.perf_counter() - started.pop("t")) * 1e3
        cpu = (time.process_time() - started.pop("cpu")) * 1e3
        if ms >= 1.0:
            events.append((time.monotonic(), f"gc{info['generation']}", ms, cpu))

async def probe():
    last_write = time.monotonic()
    while True:
        t, cpu = time.monotonic(), time.process_time()
        await asyncio.sleep(0.005)
        now = time.monotonic()
        if now - t - 0.005 >= 0.002:
            events.append((now, "lag", (now - t - 0.005) * 1e3,
                           (time.process_time() - cpu) * 1e3))
        if now - last_write > 0.5:
            with open(OUT, "w") as f:
                json.dump({"events": events, "threshold": gc.get_threshold(),
                           "frozen": gc.get_freeze_count()}, f)
            last_write = now

freeze = app.freeze_heap
def freeze_and_probe():
    freeze()
    gc.callbacks.append(on_gc)
    asyncio.get_running_loop().create_task(probe())
app.freeze_heap = freeze_and_probe
from gateway.cli import register
import argparse
p = argparse.ArgumentParser()
register(p.add_subparsers(dest="command"))
args = p.parse_args(["gateway", *sys.argv[1:]])
sys.exit(args.run(args))
"""


async def stream(session, url: str, body: dict, gaps: list[tuple[float, float]]) -> None:
    """One streamed request; each gap between chunks as (monotonic end, seconds)."""
    last = None
    async with session.post(url, json={**body, "stream": True}) as r:
        async for _line in r.content:
            now = time.monotonic()
            if last is not None:
                gaps.append((now, now - last))
            last = now


async def run(args: argparse.Namespace, probe_path: str) -> list[dict]:
    import aiohttp
    base = f"http://127.0.0.1:{args.port}"
    from shared.model_source import resolve_model
    common = {"model": resolve_model(args.model).name, "temperature": 0, "ignore_eos": True}
    prompt = "Write a long story about a lighthouse keeper and the sea."
    big = [
        ("completions logprobs+echo", "/v1/completions",
         {**common, "prompt": prompt, "max_tokens": args.max_tokens, "logprobs": args.top,
          "echo": True}),
        ("chat top_logprobs", "/v1/chat/completions",
         {**common, "messages": [{"role": "user", "content": prompt}],
          "max_tokens": args.max_tokens, "logprobs": True, "top_logprobs": args.top}),
        ("completions n=4", "/v1/completions",
         {**common, "prompt": prompt, "max_tokens": args.max_tokens // 4, "logprobs": args.top,
          "n": 4}),
        ("chat top_logprobs n=4", "/v1/chat/completions",
         {**common, "messages": [{"role": "user", "content": prompt}],
          "max_tokens": args.max_tokens // 2, "logprobs": True, "top_logprobs": args.top,
          "n": 4}),
    ]
    rows = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for name, path, body in (big[int(k)] for k in args.requests.split(",")):
            gaps: list[tuple[float, float]] = []
            streams = [asyncio.create_task(stream(
                session, f"{base}/v1/completions",
                {**common, "prompt": f"{k}: {prompt}", "max_tokens": args.max_tokens + 1000}, gaps))
                for k in range(args.streams)]
            await asyncio.sleep(2.0)                # the streams under way
            start = time.monotonic()
            async with session.post(f"{base}{path}", json=body) as r:
                answer = await r.read()
                assert r.status == 200, answer[:300]
            end = time.monotonic()
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            await asyncio.sleep(1.0)                # the probe's next write
            with open(probe_path) as f:
                probed = json.load(f)
            seen = [(kind, ms, cpu) for t, kind, ms, cpu in probed["events"]
                    if start <= t <= end]
            lags = [(ms, cpu) for k, ms, cpu in seen if k == "lag"]
            worst = max(lags, default=(0.0, 0.0))
            # a lag whose time the process spent on a CPU: its own work, not the machine's
            # other processes running instead of it
            busy = max((ms for ms, cpu in lags if cpu >= 0.8 * ms), default=0.0)
            row = {"request": name, "seconds": round(end - start, 1),
                   "answer_MB": round(len(answer) / 1e6, 1),
                   "loop_lag_max_ms": round(worst[0], 1),
                   "its_cpu_ms": round(worst[1], 1),
                   "busy_lag_max_ms": round(busy, 1)}
            for gen in range(3):
                pauses = [(ms, cpu) for k, ms, cpu in seen if k == f"gc{gen}"]
                row[f"gc{gen}_n"] = len(pauses)
                row[f"gc{gen}_max_ms"] = round(max(pauses, default=(0.0,))[0], 1)
                row[f"gc{gen}_max_cpu_ms"] = round(max((c for _, c in pauses), default=0.0), 1)
            row["stream_gap_max_ms"] = round(max((g for t, g in gaps if start <= t <= end),
                                                 default=0.0) * 1e3, 1)
            row["gc_threshold"] = probed["threshold"]
            row["frozen"] = probed["frozen"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--model", default="smollm2-135m",
                    help="the model `pacer up` serves, as its --model")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--requests", default="0,1,2,3",
                    help="which big requests to send, in order (0: completions with echo, "
                         "1: chat, 2: completions n=4, 3: chat n=4)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    probe_path = tempfile.mktemp(suffix=".json")
    gateway = subprocess.Popen(
        [sys.executable, "-c", PROBE, probe_path, "--port", str(args.port), "--redis-url",
         args.redis_url, "--model", args.model, "--max-model-len", str(args.max_model_len),
         "--max-waiting-requests", "64", "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        from tests.served_fixture import Served, wait_healthy
        wait_healthy(Served(f"http://127.0.0.1:{args.port}", args.redis_url, gateway,
                            os.devnull), timeout_s=120)
        rows = asyncio.run(run(args, probe_path))
    finally:
        gateway.terminate()
        gateway.wait(30)
    if args.json:
        from bench.common import write_json
        write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
