"""P/D's KV transfer on this machine: the default model's K/V of a 1.5k-token prompt moved by
the Mooncake transfer engine (TCP on loopback) from a prefill ModelRunner into a decode pool in
another process.

Prints (1) the connector's raw GB/s for that K/V (one coalesced write per layer, nothing
computing beside it), and (2) for the prefill itself, the last chunk carrying the sends, with
layer streaming (layer l leaves as soon as it is computed) against sending every layer after
the forward: send ms, exposed ms (what the iteration waited after its forward) and the share
of the transfer hidden behind the prefill (1 - exposed / the transfer's own time).

    python bench/kv_transfer.py [--prompt-tokens 1536] [--chunks 512,1536] [--repeats 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import print_table, random_prompts, write_json  # noqa: E402
from gpu_worker.kv_cache import block_offset  # noqa: E402
from gpu_worker.kv_transfer import make_connector  # noqa: E402
from gpu_worker.model_runner import DTYPES, build_runner  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.engine_layout import engine_layout  # noqa: E402
from shared.model_source import kv_identity  # noqa: E402
from shared.plan import CachedRequestData, IterationPlan, KVSend, NewRequestData  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def decode_pool(shape: tuple, dtype: str, to_parent, from_parent,
                model: dict | None = None) -> None:
    """The decode side: a pool of the same layout (holding `model`'s K/V: a prefill runner
    sends only to a pool of its own model), registered, until told to stop."""
    import torch
    pool = torch.zeros(shape, dtype=DTYPES[dtype])
    conn = make_connector("mooncake")
    conn.register(pool, model)
    to_parent.put(conn.descriptor())
    from_parent.get()
    conn.close()


def raw_gbs(conn, peer: dict, blocks: int, num_blocks: int, block_bytes: int, layers: int,
            repeats: int) -> tuple[float, int]:
    """The K/V of `blocks` blocks, every layer, one write per layer; best of `repeats`."""
    segments = [(block_offset(layer, kv, 0, num_blocks, block_bytes),
                 block_offset(layer, kv, 0, peer["num_blocks"], block_bytes), blocks * block_bytes)
                for layer in range(layers) for kv in (0, 1)]
    nbytes = sum(n for _, _, n in segments)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        handles = [conn.write(peer, segments[i:i + 2]) for i in range(0, len(segments), 2)]
        assert all(conn.wait(handles, 60)), "a write failed"
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9, nbytes


def prefill(runner, prompt: list[int], chunk: int, blocks: list[int], peer: dict,
            rid: str, step: int) -> tuple[dict, float, int]:
    """Prefill `prompt` in chunks of `chunk`; the last chunk sends every block. Returns the
    last iteration's kv_stats, its forward ms, and the next step."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    done = 0
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        last = done + n == len(prompt)
        plan = IterationPlan(
            step, [NewRequestData(rid, prompt, len(prompt), sampling, blocks, 0)] if not done else [],
            [CachedRequestData(rid, [], done)] if done else [], {rid: n},
            kv_sends=[KVSend(rid, "decode", blocks, blocks, [peer])] if last else [])
        result = runner.execute(plan)
        step, done = step + 1, done + n
    assert not result.kv_failed, result.kv_failed
    runner.execute(IterationPlan(step, [], [], {}, finished_request_ids=[rid]))
    return result.kv_stats, result.forward_ms, step + 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--chunks", default="512,1536", help="prefill chunk sizes to run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    blocks_needed = -(-args.prompt_tokens // 16) + 8
    layout = engine_layout(EngineArgs(model=args.model, dtype=args.dtype, kv_connector="mooncake",
                                      block_size=16, num_kv_blocks=blocks_needed))
    runner = build_runner(layout, progress=False)
    pool = runner.kv_pool
    own = runner.kv_descriptor()
    kv_dtype = str(pool.dtype).removeprefix("torch.")
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    # the same model in the same precision (what the runner registered its pool with)
    model = kv_identity(layout.source, own["weights_dtype"], own["quantization"])
    child = ctx.Process(target=decode_pool, args=(tuple(pool.shape), kv_dtype, to_parent,
                                                  from_parent, model))
    child.start()
    try:
        peer = to_parent.get(timeout=120)
        bs = layout.args.block_size
        nblocks = -(-args.prompt_tokens // bs)
        blocks = list(range(nblocks))
        gbs, nbytes = raw_gbs(runner.kv_connector, peer, nblocks, own["num_blocks"],
                              own["block_bytes"], own["num_layers"], args.repeats)
        print(f"model {args.model or 'default (smollm2-135m)'}, KV {kv_dtype}, {own['num_layers']} layers, block {bs} tokens of "
              f"{own['block_bytes']} bytes (K or V, one layer)")
        print(f"raw transfer: {nbytes / 1e6:.1f} MB of K/V for {args.prompt_tokens} tokens, "
              f"{gbs:.2f} GB/s (best of {args.repeats}, nothing computing beside it)\n")

        prompt = random_prompts(1, args.prompt_tokens, args.prompt_tokens,
                                layout.model_config.vocab_size, seed=1)[0]
        rows, step = [], 0
        streaming_rc = runner.rc
        prefill(runner, prompt, args.prompt_tokens, blocks, peer, "warm", step)   # warm-up
        for chunk in [int(c) for c in args.chunks.split(",")]:
            for streaming in (True, False):
                runner.rc = dataclasses.replace(streaming_rc, kv_layer_streaming=streaming)
                runs = []
                for k in range(args.repeats):
                    stats, forward_ms, step = prefill(runner, prompt, chunk, blocks, peer,
                                                      f"r{chunk}{streaming}{k}", step)
                    runs.append((stats, forward_ms))
                send = statistics.median(s["send_ms"] for s, _ in runs)
                rows.append({"chunk": chunk, "streaming": streaming,
                             "sends": "layer-streamed" if streaming else "after forward",
                             "last_chunk_forward_ms": statistics.median(f for _, f in runs),
                             "send_ms": send,
                             "exposed_ms": statistics.median(s["exposed_ms"] for s, _ in runs),
                             "GB/s": None if streaming else runs[0][0]["bytes"] / send / 1e6})
            # the transfer's own time is the send of the unoverlapped run; the share of it an
            # iteration no longer waits for is what layer streaming hides
            streamed, after = rows[-2], rows[-1]
            for row in (streamed, after):
                row["hidden_share"] = max(0.0, 1 - row["exposed_ms"] / after["send_ms"])
        runner.rc = streaming_rc
        print_table(rows, ["chunk", "sends", "last_chunk_forward_ms", "send_ms", "exposed_ms",
                           "GB/s", "hidden_share"])
        print("\nsend_ms: first write submitted to last seen complete; exposed_ms: what the "
              "iteration waited after its forward; hidden_share: 1 - exposed_ms / the "
              "after-forward send_ms (the transfer's own time)")
        write_json(args.json, {"raw_gbs": gbs, "bytes": nbytes, "rows": rows})
    finally:
        from_parent.put("stop")
        child.join(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
