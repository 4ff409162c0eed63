"""P/D disaggregation, measured served (docs/design.md#pd-disaggregation): steady decode
streams while ~1.5k-token prompts arrive, on the default model, two ways in one run:

- colocated: `pacer up` with chunked prefill at the defaults, its worker on every core;
- P/D: `pacer up --prefill-workers 1 --decode-workers 1`, one core per pool's worker.

Every token is stamped at the client when its SSE chunk arrives; each chunk names its tokens
(logprobs). A chunk can carry two or more: the pieces of one character, held by the detokenizer
until whole (random prompts make such text), so its gap spans two decode steps although
none was late; it counts as one gap per token, each its share. Reported per mode, first,
what each long prompt cost the streams: the worst and the median gap from its arrival to
QUIET_AFTER_S after its first token over the streams' median quiet gap in the BEFORE_S before
it (the largest over the prompts), beside "control" windows as long with no prompt in them
(`prompt_windows`); then over the whole run: the decode streams' median and worst
inter-token gap (and worst/median) once every stream is decoding
(`steady_start`; the worst/median over all gaps is printed beside it), the worst against the
median of the "quiet" gaps, those with no long prompt in the system, the same over text
chunks as a reader sees them, the long prompts' TTFT, whether the streams decoded until after the last long prompt's first
token (streams that end sooner measure nothing of it: --stream-tokens), the decoding worker's
forward thread's
time on a core and time waiting for one per decode step (Linux schedstat: what the threads
left on its core cost it); for P/D, the KV bytes per long prompt, the connector's own GB/s (measured alone after the runs)
and the share of the transfer hidden behind the prefill: 1 - (ms the prefill iterations
waited for their sends after the forward) / (the transfer's own time at that GB/s).

    python bench/disaggregation.py [--streams 6] [--long-len 1500] [--long-at 2,5]
        [--repeats 1] [--json out.json] [--plot docs/disaggregation.png]
        [--modes colocated,pd,pd-strict,pd-unpinned]    # pd-strict: the decode instance not
        # planning ahead; pd-unpinned: the forward threads without cores of their own
    python bench/disaggregation.py --threshold     # the --disagg-min-prompt-tokens cut-off

Late chunks are traced: after a run the plans and results streams of the instance that
decodes (P/D's decode instance; colocated, the one) (each entry stamped by Redis when it was
added) give every step's times — plan sent, result sent (with the tokens: one pipeline), rank
0's forward, rows — and each steady chunk gap over 1.5x the median (colocated: 3x) is printed
beside the step whose result carried it and the tokens it carried: was
the step slow (the forward, or the scheduler's turn between result and plan), the chunk late on
its way (result sent -> client), or a held character?
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402
import redis  # noqa: E402

from bench.common import print_table, random_prompts, thread_ids, write_json  # noqa: E402
from bench.served_vs_inprocess import start_served  # noqa: E402
from bench.services_cpu import find_processes  # noqa: E402
from services.bench_client import ApiTarget, SendOptions, send_request  # noqa: E402
from services.bench_dataset import BenchRequest  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.keys import Keys  # noqa: E402
from shared.model_config import load_model_config  # noqa: E402
from shared.model_source import resolve_model  # noqa: E402

QUIET_AFTER_S = 0.2     # a long prompt's first token, then this long, before gaps are "quiet"
BEFORE_S = 1.0          # the streams' gap before a prompt: the median over this long
# per mode: the instance whose steps carry the streams' tokens, and the gap (x the median)
# from which a chunk is traced as late (colocated, every gap while a prompt is chunked is
# longer by design: the worst are what to see)
LATE = {"colocated": ("", 3.0), "pd": ("d0", 1.5)}
LATE["pd-strict"] = LATE["pd-unpinned"] = LATE["pd"]
PD_FLAGS = ("--prefill-workers", "1", "--decode-workers", "1", "--prefill-threads", "1",
            "--decode-threads", "1")
MODES = {
    "colocated": (),
    "pd": PD_FLAGS,
    # the decode instance's scheduler plans each step only once the last result is in (no
    # overlap, as before it planned ahead): what planning ahead gives the decode pool
    "pd-strict": (*PD_FLAGS, "--no-overlap"),
    # the forward threads left to the kernel's placement, as before they had cores of their own
    # (docs/design.md#cores-for-the-forward-threads)
    "pd-unpinned": (*PD_FLAGS, "--no-pin-cpus"),
}
DEFAULT_MODES = "colocated,pd"


async def one_run(base_url: str, streams: list[list[int]], longs: list[list[int]],
                  long_at: list[float], args) -> dict:
    target = ApiTarget(base_url, "/v1/completions", "smollm2-135m")
    opts = SendOptions(temperature=0.0, ignore_eos=True, timeout_s=600.0, logprobs=True)
    async with aiohttp.ClientSession() as session:
        async def later(req: BenchRequest, at: float):
            await asyncio.sleep(at)
            return await send_request(session, target, req, opts)
        tasks = [later(BenchRequest(p, len(p), args.stream_tokens), 0.0) for p in streams]
        tasks += [later(BenchRequest(p, len(p), args.long_tokens), at)
                  for p, at in zip(longs, long_at)]
        results = await asyncio.gather(*tasks)
    bad = [r.error for r in results if not r.success]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0]}")
    stream_results, long_results = results[:len(streams)], results[len(streams):]
    if not streams:                 # the warm-up
        return {}
    # on the wall clock, as Redis stamps stream entries
    wall = time.time() - time.perf_counter()
    timeline = [(wall + r.sent_at + r.ttft + np.cumsum([0.0, *r.itl])).tolist()
                for r in stream_results]
    chunk_tokens = [r.chunk_tokens for r in stream_results]
    steady_from = steady_start(timeline)
    text = chunk_gaps(timeline, chunk_tokens, steady_from, per_token=False)
    gaps = chunk_gaps(timeline, chunk_tokens, steady_from)
    every = chunk_gaps(timeline, chunk_tokens, 0.0)
    # the pace with no long prompt in the system: gaps that end before one is sent or over
    # QUIET_AFTER_S after its first token (the median over every steady gap counts the
    # slower iterations of a prompt chunked beside the streams, most of a run where
    # prefill is slow)
    busy = [(wall + r.sent_at, wall + r.sent_at + r.ttft + QUIET_AFTER_S) for r in long_results]
    quiet = chunk_gaps(timeline, chunk_tokens, steady_from, outside=busy)
    # streams that end before the long prompts are in measure nothing of them (a faster decode
    # step once ended every 200-token stream before the first prompt came, and P/D looked flat)
    outlast = min(t[-1] for t in timeline) >= max(end for _, end in busy)
    windows = prompt_windows(timeline, chunk_tokens, steady_from, busy)
    return {"streams_outlast_prompts": outlast, **windows, "gap_median_ms": float(np.median(gaps)), "gap_p99_ms": float(np.percentile(gaps, 99)),
            "gap_max_ms": float(gaps.max()),
            "gap_max_over_median": float(gaps.max() / np.median(gaps)),
            "gap_quiet_median_ms": float(np.median(quiet)) if len(quiet) else float("nan"),
            "gap_max_over_quiet_median": float(gaps.max() / np.median(quiet))
            if len(quiet) else float("nan"),
            "all_gaps_max_over_median": float(every.max() / np.median(every)),
            "text_gap_max_ms": float(text.max()),
            "text_gap_max_over_median": float(text.max() / np.median(text)),
            "chunks_of_several_tokens": sum(k > 1 for c in chunk_tokens for k in c[1:]),
            "long_ttft_ms": [r.ttft * 1e3 for r in long_results],
            "long_sent_at": [wall + r.sent_at for r in long_results], "timeline": timeline,
            "chunk_tokens": chunk_tokens}


def prompt_windows(timeline: list[list[float]], chunk_tokens: list[list[int]],
                   steady_from: float, busy: list[tuple[float, float]]) -> dict:
    """What each long prompt cost the streams, against their gap just before it: the worst
    (and median) gap from its arrival until QUIET_AFTER_S after its first token, over the
    median quiet gap of the BEFORE_S before it (the last quiet BEFORE_S before it where
    another prompt was in then). The streams slow as their contexts grow and the machine has
    its own noise: the same worst-over-before of windows as long with no prompt in them, after
    the last one, is that floor ("control"); NaN where the streams ended too soon for one."""
    def gaps(since: float, until: float) -> np.ndarray:
        return chunk_gaps(timeline, chunk_tokens, since, outside=[(until, float("inf"))])

    def quiet_before(at: float) -> np.ndarray:
        ends = [t[i] for t in timeline for i in range(1, len(t))
                if steady_from < t[i] < at and not any(a <= t[i] <= b for a, b in busy)]
        if not ends:
            return np.array([])
        last = max(ends)
        return chunk_gaps(timeline, chunk_tokens, max(steady_from, last - BEFORE_S),
                          outside=[*busy, (last + 1e-6, float("inf"))])

    worst, median = [], []
    for start, end in busy:
        before, within = quiet_before(start), gaps(start, end)
        if len(before) and len(within):
            worst.append(float(within.max() / np.median(before)))
            median.append(float(np.median(within) / np.median(before)))
    control, length = [], max(end - start for start, end in busy)
    at, stop = max(end for _, end in busy) + BEFORE_S, min(t[-1] for t in timeline)
    while at + length <= stop:
        before, within = gaps(at - BEFORE_S, at), gaps(at, at + length)
        if len(before) and len(within):
            control.append(float(within.max() / np.median(before)))
        at += length
    nan = float("nan")
    return {"prompt_worst_over_before": max(worst, default=nan),
            "prompt_median_over_before": max(median, default=nan),
            "control_worst_over_before": max(control, default=nan)}


def steady_start(timeline: list[list[float]]) -> float:
    """When every stream is decoding: its second text chunk is in. Before, the streams' own
    admissions disturb each other (not the long prompts' doing), and with P/D a stream's first
    gap is its hand-off — the first token comes from the prefill instance, the second from the
    decode instance — which counts toward the hop, not the decode pool's pace (as
    docs/design.md#pd-disaggregation-pricing-the-hop counts it). The worst/median over every
    gap is reported beside."""
    return max(t[min(1, len(t) - 1)] for t in timeline)


def chunk_gaps(timeline: list[list[float]], chunk_tokens: list[list[int]], since: float,
               per_token: bool = True,
               outside: list[tuple[float, float]] = ()) -> np.ndarray:
    """Gaps (ms) between a stream's text chunks that end after `since`. A chunk can carry
    several tokens: the pieces of one character, which the detokenizer holds until it is whole
    (random token ids make many). `per_token`: such a chunk's gap counts as one gap per token,
    each its share of the time — the pace the decode pool kept, which the text could not show;
    else one gap per chunk, what a reader sees. `outside`: leave out gaps that end within any
    of these (start, end) wall-clock spans."""
    out = []
    for t, tokens in zip(timeline, chunk_tokens):
        for i in range(1, len(t)):
            if t[i] <= since or any(a <= t[i] <= b for a, b in outside):
                continue
            k = tokens[i] if per_token and i < len(tokens) else 1
            out += [(t[i] - t[i - 1]) / k] * k
    return np.array(out) * 1e3


def decoding_worker(redis_url: str, mode: str) -> int | None:
    """The pid of the worker that decodes the streams: P/D's decode worker (rank 0), or the
    one colocated worker."""
    want = "worker 0" if mode == "colocated" else "worker decode 0"
    return next((pid for pid, name in find_processes(redis_url).items() if name == want), None)


def thread_schedstats(pid: int | None) -> dict[int, tuple[int, int]]:
    """tid -> (ns on a CPU, ns runnable but waiting for one) so far (Linux schedstat)."""
    out: dict[int, tuple[int, int]] = {}
    for tid in thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        except (OSError, ValueError):
            continue
        out[int(tid)] = (run_ns, wait_ns)
    return out


def forward_wait(before: dict, after: dict, steps: int) -> dict:
    """Over a run, the decoding worker's busiest thread (its forward thread): how long it ran
    and how long it waited, runnable, for a core that another thread held, per decode step."""
    deltas = {tid: (after[tid][0] - before.get(tid, (0, 0))[0],
                    after[tid][1] - before.get(tid, (0, 0))[1]) for tid in after}
    if not deltas or not steps:
        return {}
    run_ns, wait_ns = max(deltas.values())
    return {"forward_run_ms_per_step": run_ns / steps / 1e6,
            "forward_runqueue_ms_per_step": wait_ns / steps / 1e6}


def decode_steps(redis_url: str, instance: str = "") -> list[dict]:
    """The steps of the instance that decodes (P/D's "d0", or "" colocated) from its plans and
    results streams: plan sent and result sent (wall s, Redis's stamps), rank 0's forward
    (`ms`), rows, and the chunks as (q_rows, kv_len) with the worker's wide_from_rows: the
    iterations scheduler_svc/cost_replay.py replays."""
    from shared.protocol import PlanMsg, StepResultMsg, from_fields
    client = redis.Redis.from_url(redis_url)
    keys = Keys().for_instance(instance) if instance else Keys()
    try:
        plans, results = client.xrange(keys.plans), client.xrange(keys.results)
    finally:
        client.close()

    def stamp(entry_id: bytes) -> float:
        ms, seq = entry_id.decode().split("-")
        return int(ms) / 1e3 + int(seq) * 1e-6
    steps: dict[int, dict] = {}
    for entry_id, fields in plans:
        msg = from_fields(fields)
        if isinstance(msg, PlanMsg):
            plan = msg.plan
            computed = {r.request_id: r.num_computed_tokens
                        for r in [*plan.new_requests, *plan.cached_requests]}
            steps[plan.step] = {"plan_s": stamp(entry_id),
                                "rows": sum(plan.num_scheduled_tokens.values()),
                                "new": len(plan.new_requests),
                                "chunks": [[n, computed.get(rid, 0) + n] for rid, n
                                           in plan.num_scheduled_tokens.items()]}
    for entry_id, fields in results:
        msg = from_fields(fields)
        if isinstance(msg, StepResultMsg) and msg.result.step in steps:
            steps[msg.result.step].update(result_s=stamp(entry_id),
                                          ms=msg.result.forward_ms or 0.0,
                                          wide_from_rows=msg.result.wide_from_rows)
    return [{"step": k, **v} for k, v in sorted(steps.items()) if "result_s" in v]


def late_tokens(run: dict, steps: list[dict], factor: float = 1.5) -> list[dict]:
    """Each steady gap between text chunks over `factor` x the median, with the decode step
    whose result carried its chunk (the last result sent before it reached the client) and
    how many tokens the chunk carried."""
    timeline, chunk_tokens = run["timeline"], run["chunk_tokens"]
    steady_from = steady_start(timeline)
    gaps = [(t[i] - t[i - 1], t[i], s, chunk_tokens[s][i] if i < len(chunk_tokens[s]) else 1)
            for s, t in enumerate(timeline) for i in range(1, len(t)) if t[i] > steady_from]
    median = float(np.median([g for g, _, _, _ in gaps]))
    result_s = np.array([st["result_s"] for st in steps])
    rows = []
    for gap, at, stream, tokens in gaps:
        if gap <= factor * median:
            continue
        i = int(np.searchsorted(result_s, at)) - 1
        st, before = steps[i], steps[i - 1] if i > 0 else None
        same = sum(1 for t in timeline for x in t if abs(x - at) < 0.010)
        rows.append({"at_s": at - min(t[0] for t in timeline), "stream": stream,
                     "gap_ms": gap * 1e3, "chunk_tokens": tokens, "step": st["step"],
                     "delivery_ms": (at - st["result_s"]) * 1e3,
                     "step_ms": (st["result_s"] - before["result_s"]) * 1e3 if before else None,
                     "forward_ms": st["ms"],
                     "sched_turn_ms": (st["plan_s"] - before["result_s"]) * 1e3 if before else None,
                     "plan_to_result_ms": (st["result_s"] - st["plan_s"]) * 1e3,
                     "rows": st["rows"], "new_requests": st["new"],
                     "tokens_within_10ms": same})
    return rows


def raw_transfer_gbs(long_len: int, dtype: str) -> float:
    """The connector's own GB/s for one long prompt's K/V, nothing computing beside it
    (bench/kv_transfer.py's measurement): what the transfer would cost if nothing hid it."""
    import multiprocessing as mp

    import torch

    from bench.kv_transfer import decode_pool, raw_gbs
    from gpu_worker.kv_transfer import make_connector
    from gpu_worker.model_runner import DTYPES
    from shared.config import kv_cache_dtype
    from shared.model_config import quantization_scheme
    source = resolve_model(None)
    cfg = load_model_config(source)
    blocks = -(-long_len // 16)
    kv_dtype = kv_cache_dtype(EngineArgs(dtype=dtype).resolved().dtype, "cpu",
                              quantization_scheme("auto", source, "cpu"))
    shape = (cfg.num_layers, 2, blocks, 16, cfg.num_kv_heads, cfg.head_dim)
    pool = torch.zeros(shape, dtype=DTYPES[kv_dtype])
    conn = make_connector("mooncake")
    conn.register(pool)
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=decode_pool, args=(shape, kv_dtype, to_parent, from_parent))
    child.start()
    try:
        peer = to_parent.get(timeout=120)
        own = conn.descriptor()
        gbs, _ = raw_gbs(conn, peer, blocks, blocks, own["block_bytes"], cfg.num_layers, 3)
    finally:
        from_parent.put(None)
        child.join(30)
        conn.close()
    return gbs


def transfer_figures(redis_url: str, longs: int) -> dict:
    client = redis.Redis.from_url(redis_url)
    try:
        s, d = ({k.decode(): float(v) for k, v in
                 client.hgetall(Keys().for_instance(instance).stats).items()}
                for instance in ("p0", "d0"))
    finally:
        client.close()
    sent, send_s = s.get("kv_transfer_bytes_total", 0.0), s.get("kv_transfer_seconds_total", 0.0)
    exposed = s.get("kv_transfer_exposed_seconds_total", 0.0)
    return {"kv_bytes_per_long_prompt": sent / max(longs, 1),
            "transfer_ms_per_long_prompt": send_s * 1e3 / max(longs, 1),
            "exposed_ms_per_long_prompt": exposed * 1e3 / max(longs, 1),
            "handoffs": s.get("handoffs_total", 0.0),
            "kv_failures": s.get("kv_transfer_failures_total", 0.0),
            # the decode side: K/V that failed its check, hand-offs recomputed for any reason
            "kv_check_failures": d.get("kv_check_failures_total", 0.0),
            "recomputed": d.get("handoffs_recomputed_total", 0.0),
            "ttft_goal_met": s.get("ttft_goal_met_total", 0.0),
            "ttft_goal_missed": s.get("ttft_goal_missed_total", 0.0)}


def plot(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for run, colour in zip(runs, ("C0", "C2")):
        t0 = min(t[0] for t in run["timeline"])
        for i, t in enumerate(run["timeline"]):
            t = np.array(t) - t0
            ax.plot(t[1:], np.diff(t) * 1e3, ".", ms=3, color=colour,
                    label=run["mode"] if i == 0 else None)
        for at in run["long_sent_at"]:
            ax.axvline(at - t0, color=colour, ls=":", lw=0.8)
    ax.set(yscale="log", xlabel="seconds since the streams started",
           ylabel="decode inter-token gap (ms)",
           title="decode streams while ~1.5k-token prompts arrive (dotted)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def threshold(args) -> list[dict]:
    """Conditional disaggregation's cut-off, in-process: the iteration time of `--streams`
    decodes alone against the same decodes with an L-token prompt riding along whole, for
    each L (alternated, median of `--threshold-repeats`). A prompt whose ride costs the
    streams less than `--threshold-ratio` x their gap is cheaper to prefill on the decode
    instance than to move."""
    from services.engine import LLMEngine
    from shared.sampling import SamplingParams
    engine = LLMEngine(EngineArgs(dtype=args.dtype, target_tbt_ms="off",
                                  max_num_batched_tokens=2048), progress=False)
    cfg = engine.model_config
    avoid = tuple(cfg.eos_token_ids)
    decode_sp = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(args.streams, 16, 48, cfg.vocab_size, 7, avoid)):
        engine.add_request(p, decode_sp, request_id=f"s{i}")
    for _ in range(3):
        engine.step()                   # every stream past its prompt

    def timed_step() -> float:
        t = time.perf_counter()
        engine.step()
        return (time.perf_counter() - t) * 1e3

    rows = []
    for n, length in enumerate(int(x) for x in args.threshold_lengths.split(",")):
        alone, riding = [], []
        for k in range(args.threshold_repeats):
            alone.append(timed_step())
            prompt = random_prompts(1, length, length, cfg.vocab_size, 1000 * n + k, avoid)[0]
            engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0),
                               request_id=f"p{length}-{k}")
            riding.append(timed_step())
        a, r = float(np.median(alone)), float(np.median(riding))
        rows.append({"prompt_tokens": length, "decode_ms": a, "with_prompt_ms": r,
                     "ratio": r / a})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=6)
    # long enough that the streams decode until after the last long prompt's first token
    # (checked each run: streams_outlast_prompts)
    ap.add_argument("--stream-tokens", type=int, default=800)
    ap.add_argument("--long-len", type=int, default=1500)
    ap.add_argument("--long-tokens", type=int, default=4)
    ap.add_argument("--long-at", default="2,5", help="seconds after the streams start")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--modes", default=DEFAULT_MODES, help="of: " + ", ".join(MODES))
    ap.add_argument("--threshold", action="store_true",
                    help="only measure the conditional-disaggregation cut-off (in-process)")
    ap.add_argument("--threshold-lengths", default="16,32,64,128,256,512,1024")
    ap.add_argument("--threshold-repeats", type=int, default=7)
    ap.add_argument("--threshold-ratio", type=float, default=1.5)
    args = ap.parse_args()
    if args.threshold:
        rows = threshold(args)
        flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
        print(f"{args.streams} decode streams, dtype {args.dtype}, {os.cpu_count()} cores, "
              f"CPU flags {' '.join(flags)}")
        print_table(rows, ["prompt_tokens", "decode_ms", "with_prompt_ms", "ratio"])
        fits = [r["prompt_tokens"] for r in rows if r["ratio"] <= args.threshold_ratio]
        print(f"longest prompt that costs the streams at most {args.threshold_ratio}x their "
              f"gap: {max(fits) if fits else None} tokens")
        write_json(args.json, {"threshold": rows, "args": vars(args), "cpu_flags": flags})
        return
    long_at = [float(x) for x in args.long_at.split(",")]
    cfg = load_model_config(resolve_model(None))
    avoid = tuple(cfg.eos_token_ids)
    engine = EngineArgs.serving(dtype=args.dtype, kv_cache_memory="512MiB")
    rows, runs = [], []
    logs = tempfile.mkdtemp(prefix="pacer-disagg-")
    for rep in range(args.repeats):
        streams = random_prompts(args.streams, 16, 48, cfg.vocab_size, rep, avoid)
        longs = random_prompts(len(long_at), args.long_len - 100, args.long_len + 100,
                               cfg.vocab_size, 100 + rep, avoid)
        for mode in args.modes.split(","):
            flags = MODES[mode]
            system = start_served(engine, "smollm2-135m", os.path.join(logs, f"{mode}-{rep}.log"),
                                  flags)
            try:
                warm = random_prompts(1, args.long_len, args.long_len, cfg.vocab_size, 999, avoid)
                asyncio.run(one_run(system.base_url, [], warm, [0.0], args))   # warm-up
                base = transfer_figures(system.redis_url, 1) if mode != "colocated" else {}
                decoder = decoding_worker(system.redis_url, mode)
                sched_before, began = thread_schedstats(decoder), time.time()
                run = asyncio.run(one_run(system.base_url, streams, longs, long_at, args))
                sched_after, ended = thread_schedstats(decoder), time.time()
                time.sleep(0.5)                          # the last stats write
                figures = transfer_figures(system.redis_url, 1) if mode != "colocated" else {}
                run["steps"] = decode_steps(system.redis_url, LATE[mode][0])
                waits = forward_wait(sched_before, sched_after, sum(
                    1 for step in run["steps"] if step["rows"]
                    and began <= step["result_s"] <= ended))
                run["late"] = late_tokens(run, run["steps"], LATE[mode][1])
                if figures:      # minus the warm-up's prompt
                    n = len(longs)
                    for k in ("kv_bytes_per_long_prompt", "transfer_ms_per_long_prompt",
                              "exposed_ms_per_long_prompt"):
                        figures[k] = (figures[k] - base[k]) / n
            finally:
                system.stop()
            run["mode"], run["repeat"] = mode, rep
            runs.append(run)
            rows.append({"repeat": rep, "mode": mode,
                         **{k: v for k, v in run.items() if "gap" in k or "over_before" in k},
                         "chunks_of_several_tokens": run["chunks_of_several_tokens"],
                         "streams_outlast_prompts": run["streams_outlast_prompts"],
                         "long_ttft_median_ms": float(np.median(run["long_ttft_ms"])),
                         **waits, **figures})
    gbs = raw_transfer_gbs(args.long_len, args.dtype)
    for row in rows:
        if "kv_bytes_per_long_prompt" in row:       # against the transfer's own time
            own_ms = row["kv_bytes_per_long_prompt"] / gbs / 1e6
            row["transfer_own_ms"] = own_ms
            row["hidden_share"] = 1.0 - row["exposed_ms_per_long_prompt"] / own_ms
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"{args.streams} decode streams x {args.stream_tokens} tokens, prompts of "
          f"~{args.long_len} tokens at {args.long_at} s, dtype {args.dtype}, "
          f"{os.cpu_count()} cores, CPU flags {' '.join(flags)}; logs in {logs}")
    print(f"What each long prompt cost the streams: the worst and the median gap from its "
          f"arrival to {QUIET_AFTER_S:g} s after its first token, over the streams' median gap "
          f"in the {BEFORE_S:g} s before it (the largest over the prompts); control: the worst "
          f"over the same of windows as long with no prompt in them (the streams' own drift "
          f"and the machine's noise)")
    print_table(rows, ["repeat", "mode", "prompt_worst_over_before", "prompt_median_over_before",
                       "control_worst_over_before", "long_ttft_median_ms"])
    print("\nOver the whole run")
    print_table(rows, ["repeat", "mode", "gap_median_ms", "gap_p99_ms", "gap_max_ms",
                       "gap_max_over_median", "gap_quiet_median_ms", "gap_max_over_quiet_median",
                       "all_gaps_max_over_median", "text_gap_max_ms",
                       "text_gap_max_over_median", "chunks_of_several_tokens",
                       "long_ttft_median_ms", "streams_outlast_prompts"])
    short = [f"{r['mode']}-{r['repeat']}" for r in rows if not r["streams_outlast_prompts"]]
    if short:
        print(f"WARNING: in {', '.join(short)} the streams ended before the last long prompt's "
              f"first token: those runs do not measure what the prompts cost them; give "
              f"--stream-tokens more than {args.stream_tokens}")
    print("\nThe decoding worker's forward thread over the run, per decode step (Linux "
          "schedstat): on a core, and runnable but waiting while another thread held its core")
    print_table(rows, ["repeat", "mode", "forward_run_ms_per_step",
                       "forward_runqueue_ms_per_step"])
    pd = [r for r in rows if r["mode"] != "colocated"]
    if pd:
        print(f"\nP/D transfer per long prompt (the connector alone: {gbs:.2f} GB/s; send ms spans "
              "the prefill iterations that carried it, exposed ms is what they waited after "
              "their forward)")
        print_table(pd, ["repeat", "mode", "kv_bytes_per_long_prompt", "transfer_own_ms",
                         "transfer_ms_per_long_prompt", "exposed_ms_per_long_prompt",
                         "hidden_share", "handoffs", "kv_failures", "kv_check_failures",
                         "recomputed", "ttft_goal_met",
                         "ttft_goal_missed"])
    for run in runs:
        if run.get("late"):
            late = sorted(run["late"], key=lambda r: -r["gap_ms"])[:12]
            print(f"\nLate text chunks, run {run['mode']} (steady gaps over "
                  f"{LATE[run['mode']][1]:g}x the median; the {len(late)} longest of "
                  f"{len(run['late'])}): the step whose result carried each; delivery = result "
                  "sent -> client")
            print_table(late, list(late[0]))
    write_json(args.json, {"rows": rows, "args": vars(args), "cpu_flags": flags,
                           "connector_gb_per_s": gbs,
                           "late_tokens": [run.get("late", []) for run in runs],
                           "timelines": {run["mode"]: {"timeline": run["timeline"],
                                                       "chunk_tokens": run["chunk_tokens"],
                                                       "long_sent_at": run["long_sent_at"],
                                                       "long_ttft_ms": run["long_ttft_ms"]}
                                         for run in runs},
                           # the decoding instance's steps, in the form
                           # scheduler_svc/cost_replay.py reads (ms: rank 0's forward)
                           "iterations": {f"{run['mode']}-{run['repeat']}": run["steps"]
                                          for run in runs}}, indent=None)
    if args.plot:
        plot([run for run in runs if run["repeat"] == 0
              and run["mode"] in DEFAULT_MODES.split(",")], args.plot)


if __name__ == "__main__":
    main()
