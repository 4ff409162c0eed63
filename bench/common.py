"""Helpers the benchmarks share: seeded workloads, bandwidth measurement, table printing,
CPU time from /proc."""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from shared.openmp import default_omp_wait_policy

default_omp_wait_policy()      # before torch loads OpenMP
import torch  # noqa: E402


def random_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0,
                   avoid: tuple[int, ...] = ()) -> list[list[int]]:
    """n prompts of random token ids with lengths uniform in [min_len, max_len] (vLLM's
    'random' dataset); special ids in `avoid` are skipped."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = []
        length = rng.randint(min_len, max_len)
        while len(ids) < length:
            t = rng.randrange(vocab)
            if t not in avoid:
                ids.append(t)
        out.append(ids)
    return out


def engine_arg_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a benchmark that builds engines in process: every engine flag, a 512 MiB
    KV pool by default (a shared machine; some build two engines), and --json."""
    from shared.engine_args import EngineArgs
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    EngineArgs.add_cli_args(ap)
    ap.set_defaults(kv_cache_memory="512MiB")
    ap.add_argument("--json", default=None, help="write the results here")
    return ap


def measure_bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    """Read bandwidth from summing a large float32 tensor (best of a few)."""
    x = torch.ones(mb * 1024 * 1024 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def best_ms(fn, repeats: int = 5) -> float:
    """The fastest of `repeats` calls of fn, in ms (a shared, noisy machine: the best run is
    the one least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def hf_default_model(dtype: str):
    """transformers' model of the default model (its GGUF, widened), in `dtype`, for eval."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from shared.model_source import resolve_model
    src = resolve_model(None)
    folder = tempfile.mkdtemp()
    os.symlink(src.path, os.path.join(folder, os.path.basename(src.path)))
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=os.path.basename(src.path),
                                                torch_dtype=getattr(torch, dtype)).eval()


def write_json(path: str | None, data: dict, indent: int | None = 2) -> None:
    """`indent` None: one line, for data of many numbers (a timeline of thousands)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent, separators=None if indent else (",", ":"))


def run_random_workload(base_url: str, model: str, num_prompts: int, concurrency: int,
                        seed: int, input_len: int = 106, output_len: int = 64,
                        model_source: str | None = None) -> dict:
    """`pacer bench`'s random workload (greedy, EOS ignored) against an OpenAI-compatible
    server serving `model`; its metrics. `model_source`: the tokenizer's (default model)."""
    from services.bench_client import ApiTarget, SendOptions, compute_metrics, run_requests
    from services.bench_cmd import run_async
    from services.bench_dataset import random_dataset
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model(model_source))
    reqs = random_dataset(tok, num_prompts, input_len, output_len, 0.0, seed=seed)
    target = ApiTarget(base_url, "/v1/completions", model, None)
    results, duration = run_async(run_requests(target, reqs, SendOptions(0.0, True, 600.0),
                                               max_concurrency=concurrency))
    return compute_metrics(results, duration)


def cpu_ticks(stat_path: str) -> int:
    """User plus system clock ticks of the process or thread whose /proc stat file this is;
    0 once it is gone."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError):
        return 0


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, children first, from /proc (`pacer up` starts each service in
    a session of its own: its process group is not all of them)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def thread_ids(pid: int | None) -> list[int]:
    """The threads of process `pid` (none once it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")] if pid else []
    except OSError:
        return []
