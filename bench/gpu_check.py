"""The prepared GPU check (issue 14; docs/gpu.md), one JSON file out:

  (a) parity: a tiny random Llama, greedy tokens on the device (float32, TF32 off) equal to the
      CPU float32 reference path; bfloat16 top-1 agreement with the float32 reference over a
      teacher-forced sequence (1k positions; 128 in smoke mode).
  (b) speed: a random-weight model of Llama-3-8B's shape (a small one in smoke mode), in-process
      decode tok/s at a few batch sizes, with CUDA graphs and without, and one long prefill,
      each beside the roofline of `pacer cost` for the same shape and hardware (the ratio is
      the figure that matters).
  (c) served: the same random-weight model behind `pacer up` (`--load-format dummy`) against
      the same engine in-process at concurrency 64 (bench/served_vs_inprocess.py): the ratio
      shows whether the Redis hop is hidden. Needs redis-server on the PATH.

    python -m bench.gpu_check --device cuda --out docs/gpu_check.json     # on a GPU
    python -m bench.gpu_check --device cpu --out /tmp/smoke.json          # smoke mode (CI)

Smoke mode (--device cpu) runs the same code on tiny shapes so that the script is not broken
when a GPU arrives; there the device under test runs our Triton kernel under TRITON_INTERPRET=1
(when triton is installed), so (a) compares it with the torch path end to end. Its speed
figures mean nothing, and (c) is skipped (two engines and a Redis on the CI machine's two
cores would add minutes and say nothing). Each part that fails leaves its traceback in the
JSON and the others still run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback

SMOKE_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=2, vocab_size=512)
LLAMA3_8B_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda[:N], or cpu for the smoke mode")
    ap.add_argument("--out", default="gpu_check.json", help="the JSON file to write")
    ap.add_argument("--attention-backend", default="auto",
                    help="the device run's backend (smoke mode: triton when installed)")
    ap.add_argument("--hw", default="h200", help="hardware profile for the roofline")
    ap.add_argument("--skip-speed", action="store_true", help="no (b)")
    ap.add_argument("--skip-served", action="store_true", help="no (c)")
    ap.add_argument("--profile", action="store_true",
                    help="(b) also lists the GPU time per kernel of eager decode steps")
    args = ap.parse_args(argv)
    smoke = args.device == "cpu"
    backend = args.attention_backend
    if smoke and backend == "auto":
        import importlib.util
        if importlib.util.find_spec("triton") is not None:
            os.environ.setdefault("TRITON_INTERPRET", "1")       # before triton is imported
            backend = "triton"
        else:
            backend = "torch"

    import torch
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    report: dict = {"device": args.device, "smoke": smoke, "attention_backend": backend,
                    "torch": torch.__version__, "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name(args.device)
                    if args.device.startswith("cuda") else None,
                    }
    started = time.perf_counter()

    def part(name, fn, *fn_args):
        t0 = time.perf_counter()
        try:
            report[name] = fn(*fn_args)
        except Exception:                   # keep going: the other parts still tell something
            report[name] = {"error": traceback.format_exc()}
            print(report[name]["error"], file=sys.stderr)
        report.setdefault("part_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        with open(args.out, "w") as f:      # after every part: a killed run keeps what it had
            json.dump(report, f, indent=2)

    with tempfile.TemporaryDirectory() as tmp:
        part("parity", parity, tmp, args.device, backend, smoke)
        if not smoke:
            part("kernels", kernels, args.device)
        if not args.skip_speed:
            # smoke mode times the torch path: the interpreter's speed says nothing
            part("speed", speed, args.device, "torch" if smoke else backend, smoke, args.hw,
                 args.profile)
        if not smoke and not args.skip_served:
            part("served", served, tmp, args.device)
    report["seconds"] = round(time.perf_counter() - started, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    p = report["parity"]
    k = report.get("kernels", {})
    ok = not any("error" in v for v in report.values() if isinstance(v, dict)) and \
        p["greedy_equal"] and p["bf16_top1_agreement"] >= p["bf16_threshold"] and \
        p["prompt_logprobs_max_abs_error"] < 1e-3 and p["structured_equal"] and \
        k.get("rope_store_equal", True) and k.get("argmax_equal", True) and \
        all(err < (1e-3 if key.startswith("float32") else 0.1) for key, err in
            k.get("split_decodes_max_abs_error_against_torch", {}).items())
    print(json.dumps({"out": args.out, "ok": ok, "parity": report["parity"]}, indent=2))
    return 0 if ok else 1


# ---- (a) parity ---------------------------------------------------------------------------

def _engine(model: str, device: str, dtype: str, backend: str):
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    return LLMEngine(EngineArgs(model=model, device=device, dtype=dtype, attention_backend=backend,
                                num_kv_blocks=256, block_size=16), progress=False)


def _greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from shared.sampling import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts, [sp] * len(prompts))]


def _prompt_logprobs(engine, prompt: list[int]) -> list[float]:
    """The prompt's own log-probabilities (echo with logprobs), positions 1.."""
    from shared.sampling import SamplingParams
    [c] = engine.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=1,
                                                    prompt_logprobs=2)])
    return [c.prompt_logprobs[pos].logprob for pos in range(1, len(prompt))]


def _constrained(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy under a grammar (structured outputs): the mask is unpacked on the device."""
    from shared.sampling import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=12,
                        structured_outputs={"regex": "[0-9]{3}-[a-z]{4}"})
    return [c.token_ids for c in engine.generate(prompts, [sp] * len(prompts))]


def _teacher_forced_logits(engine, ids: list[int]):
    """logits of every position of one prefill of `ids`: [len(ids), V] float32 on the host.
    Its K/V go into the pool's first blocks, which the scheduler does not know of: the
    engine's last use."""
    import torch
    from gpu_worker.attention import Chunk, build_attention_metadata
    runner = engine.runner
    bs = runner.rc.block_size
    n = len(ids)
    meta = build_attention_metadata([Chunk(n, n, list(range(-(-n // bs))))], bs,
                                    runner.rc.device, runner.act_dtype)
    meta.sample_rows = torch.arange(n, device=runner.rc.device)
    with torch.inference_mode():
        logits = runner.model(torch.tensor(ids, device=runner.rc.device), runner.kv_caches, meta,
                              runner.backend)
    return logits.float().cpu()


def _margins(ref_logits, ref_top1, other_top1) -> list[float]:
    import torch
    rows = torch.nonzero(ref_top1 != other_top1).flatten()
    return sorted(round(float(ref_logits[r, ref_top1[r]] - ref_logits[r, other_top1[r]]), 5)
                  for r in rows)


def _hf_top1(model_dir: str, device: str, ids: list[int]):
    """transformers' bfloat16 model on `device`: argmax of every position of `ids`."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    with torch.inference_mode():
        top1 = hf(torch.tensor([ids], device=device)).logits[0].argmax(-1).cpu()
    del hf
    return top1


def parity(tmp: str, device: str, backend: str, smoke: bool) -> dict:
    import random

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.helpers_tiny_model import write_tiny_llama
    model = write_tiny_llama(os.path.join(tmp, "tiny"), seed=0, max_position_embeddings=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 40, 33)]
    prompts = prompts[:3] if smoke else prompts
    steps = 8 if smoke else 64
    positions = 128 if smoke else 1024
    forced = [rng.randrange(3, 200) for _ in range(positions)]

    ref = _engine(model, "cpu", "float32", "torch")
    ref_tokens = _greedy(ref, prompts, steps)
    ref_scored = _prompt_logprobs(ref, prompts[-1])
    ref_constrained = _constrained(ref, prompts)
    # last: it writes K/V into the pool's first blocks behind the prefix cache's back
    ref_logits = _teacher_forced_logits(ref, forced)
    ref_top1 = ref_logits.argmax(-1)
    ref.shutdown()

    dut = _engine(model, device, "float32", backend)
    dut_tokens = _greedy(dut, prompts, steps)
    dut_scored = _prompt_logprobs(dut, prompts[-1])
    dut_constrained = _constrained(dut, prompts)
    dut.shutdown()
    # bf16 on the device (on CPU the residual stream stays float32: shared/config.py)
    bf = _engine(model, device, "bfloat16", backend)
    bf_top1 = _teacher_forced_logits(bf, forced).argmax(-1)
    bf.shutdown()
    hf_top1 = _hf_top1(model, device, forced)
    return {"prompts": len(prompts), "greedy_steps": steps,
            "greedy_equal": dut_tokens == ref_tokens,
            "first_mismatch": next(([i, j] for i, (a, b) in enumerate(zip(dut_tokens, ref_tokens))
                                    for j, (x, y) in enumerate(zip(a, b)) if x != y), None),
            # echo with logprobs on the device, float32, against the CPU's
            "prompt_logprobs_max_abs_error": max(abs(a - b) for a, b in zip(dut_scored,
                                                                             ref_scored)),
            # greedy under a grammar, its mask applied on the device, against the CPU's
            "structured_equal": dut_constrained == ref_constrained,
            "bf16_positions": positions,
            "bf16_top1_agreement": float((bf_top1 == ref_top1).float().mean()),
            # the same measure for transformers' own bfloat16 model on the device: what
            # bfloat16 costs this random model's close logits anyway
            "hf_bf16_top1_agreement": float((hf_top1 == ref_top1).float().mean()),
            # where bfloat16 picked another token: how far below float32's top logit it was,
            # beside the spread of the logits (a near-tie is a margin far below the spread)
            "bf16_disagreement_margins": _margins(ref_logits, ref_top1, bf_top1),
            "fp32_logit_std": float(ref_logits.std()),
            # a tiny random model's logits are close together: the smoke run's bar is lower
            "bf16_threshold": 0.95 if smoke else 0.99}


# ---- (a') our kernels on the device --------------------------------------------------------

def kernels(device: str) -> dict:
    """Each Triton kernel of the GPU path against what it replaces, on the device: the split-KV
    decode merged in the attention kernel (its atomic count) and by a kernel of its own, against
    the torch backend, over many calls of random decode batches; RoPE + K/V store in one
    launch against rope_ and write_kv (bit for bit); the one-row GEMM on Llama-3-8B's matrices
    against float32 (and cuBLAS's time beside ours, and which one serves); the argmax."""
    import random
    from unittest import mock

    import torch
    import torch.nn.functional as F
    from gpu_worker.attention import Chunk, build_attention_metadata, triton_backend
    from gpu_worker.attention.torch_backend import TorchAttentionBackend, write_kv
    from gpu_worker.model import triton_gemv, triton_ops
    from gpu_worker.model.layers import RotaryEmbedding
    out: dict = {}
    rng = random.Random(0)
    g = torch.Generator(device=device).manual_seed(0)
    bs, heads, kvh, d, max_len = 16, 32, 8, 128, 4096
    blocks = 64 * -(-max_len // bs)                      # the largest batch at the longest
    worst = {}
    for dtype in (torch.bfloat16, torch.float32):
        kc = torch.randn(blocks, bs, kvh, d, generator=g, device=device).to(dtype)
        vc = torch.randn(blocks, bs, kvh, d, generator=g, device=device).to(dtype)
        for call in range(100 if dtype == torch.bfloat16 else 20):
            n = rng.choice([1, 1, 2, 3, 8, 17, 64])
            lens = [rng.randrange(1, max_len + 1) for _ in range(n)]
            perm = torch.randperm(blocks).tolist()
            chunks, used = [], 0
            for kv in lens:
                chunks.append(Chunk(1, kv, perm[used:used + -(-kv // bs)]))
                used += -(-kv // bs)
            meta = build_attention_metadata(chunks, bs, device, dtype)
            q, k, v = (torch.randn(n, h, d, generator=g, device=device).to(dtype)
                       for h in (heads, kvh, kvh))
            # the torch backend stores this step's K/V, then both read the same caches
            ref = TorchAttentionBackend(None).forward(q, k, v, kc, vc, meta, d ** -0.5).float()
            for fused in (True, False):
                with mock.patch.object(triton_backend, "FUSED_COMBINE", fused):
                    o = triton_backend.paged_attention(q, kc, vc, meta, d ** -0.5).float()
                key = f"{str(dtype)[6:]}, merged {'in the attention kernel' if fused else 'apart'}"
                worst[key] = max(worst.get(key, 0.0), float((o - ref).abs().max()))
    out["split_decodes_max_abs_error_against_torch"] = worst
    rotary = RotaryEmbedding(d, 8192, 5e5).to(device)
    T = 64
    qkv = torch.randn(T, (heads + 2 * kvh) * d, generator=g, device=device).to(torch.bfloat16)
    positions = torch.randint(0, 8192, (T,), generator=g, device=device)
    slots = torch.randperm(64 * bs, device=device)[:T]
    pool = torch.randn(2, 64, bs, kvh, d, generator=g, device=device).to(torch.bfloat16)
    want_pool, want_qkv = pool.clone(), qkv.clone()
    qk = want_qkv[:, :(heads + kvh) * d].view(T, -1, d)
    triton_ops.rope_(qk, positions, rotary.cos, rotary.sin)
    write_kv(qk[:, heads:], want_qkv[:, (heads + kvh) * d:].view(T, kvh, d), want_pool[0],
             want_pool[1], slots)
    triton_ops.rope_store_(qkv, positions, slots, rotary.cos, rotary.sin, pool[0], pool[1],
                           heads, kvh, d)
    q_end, v_start = heads * d, (heads + kvh) * d       # keys go to the cache alone
    out["rope_store_equal"] = bool(torch.equal(pool, want_pool) and
                                   torch.equal(qkv[:, :q_end], want_qkv[:, :q_end]) and
                                   torch.equal(qkv[:, v_start:], want_qkv[:, v_start:]))
    gemv = {}
    for name, (n_out, k_in) in {"qkv": (6144, 4096), "o": (4096, 4096),
                                "gate_up": (28672, 4096), "down": (4096, 14336)}.items():
        w = (torch.randn(n_out, k_in, generator=g, device=device) * 0.02).to(torch.bfloat16)
        x = torch.randn(1, k_in, generator=g, device=device).to(torch.bfloat16)
        serves = triton_gemv.serves(x, w)
        ref = F.linear(x.float(), w.float())
        err = float(((triton_gemv.gemv(x, w).float() - ref).abs().max() / ref.abs().max()))
        ours = triton_gemv._time(lambda: triton_gemv.gemv(x, w), 50)
        theirs = triton_gemv._time(lambda: F.linear(x, w), 50)
        gemv[name] = {"shape": [n_out, k_in], "serves": serves, "max_rel_error": err,
                      "triton_us": round(ours * 1e3, 1), "cublas_us": round(theirs * 1e3, 1),
                      "triton_tb_s": round(w.numel() * 2 / ours / 1e9, 2),
                      "cublas_tb_s": round(w.numel() * 2 / theirs / 1e9, 2)}
    out["one_row_gemm"] = gemv
    equal = True
    for rows in (1, 7, 256):
        x = torch.randn(rows, 128256, generator=g, device=device)
        x[0, 5] = x[0, 100000] = x[0].max() + 1
        equal &= bool(torch.equal(triton_ops.argmax_rows(x), x.argmax(-1)))
    out["argmax_equal"] = equal
    print("kernels:", json.dumps(out), file=sys.stderr, flush=True)
    return out


# ---- (b) speed ----------------------------------------------------------------------------

def _random_model(shape: dict, device: str, dtype):
    """A llama of `shape` with random weights, built on the device in its dtype (no files)."""
    import torch
    from gpu_worker.model.llama import LlamaForCausalLM
    from gpu_worker.parallel import SINGLE
    from shared.config import activation_dtype
    from shared.model_config import ModelConfig
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    cfg = ModelConfig("LlamaForCausalLM", shape["vocab_size"], shape["hidden_size"],
                      shape["intermediate_size"], shape["num_hidden_layers"],
                      shape["num_attention_heads"], shape["num_key_value_heads"], head_dim,
                      5e5, 1e-5, 8192, False, 1, 2)
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    act = getattr(torch, activation_dtype(name, device))
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, SINGLE)
    finally:
        torch.set_default_dtype(before)
    model.init_random()
    fused = None
    if device == "cpu" and dtype != act:
        from gpu_worker.cpu_kernels import cpu_kernels
        fused = cpu_kernels()
    model.set_dtypes(dtype, act, fused)
    return cfg, model.eval(), act


def speed(device: str, backend: str, smoke: bool, hw_name: str, profile: bool = False) -> dict:
    import torch
    from gpu_worker.attention import Chunk, build_attention_metadata, select_backend
    from gpu_worker.cuda_graphs import CAPTURABLE_BACKENDS, DecodeGraphs
    from gpu_worker.kv_cache import allocate_kv_cache
    from gpu_worker.sampler import argmax
    from shared.cost_model import ModelShape, estimate_iteration
    from shared.attention_choice import choose_attention_here
    from shared.hardware import load_hardware

    shape = SMOKE_SHAPE if smoke else LLAMA3_8B_SHAPE
    dtype = torch.bfloat16
    batches, context, prefill, steps = ((1, 4, 16), 64, 128, 3) if smoke else \
        ((1, 32, 256), 1024, 4096, 20)
    choice = choose_attention_here(backend, device, "bfloat16", None)
    bs = choice.block_size
    cfg, model, act = _random_model(shape, device, dtype)
    attn = select_backend(choice.backend, device, bs)
    per_seq = -(-(context + steps + 8) // bs)
    num_blocks = max(max(batches) * per_seq, -(-prefill // bs))
    # one block more: the graphs' padding rows write there (gpu_worker/cuda_graphs.py)
    caches = allocate_kv_cache(cfg, num_blocks + 1, bs, cfg.num_kv_heads, dtype, device)
    hw = load_hardware(hw_name)
    mshape = ModelShape("llama-3-8b-shape" if not smoke else "smoke-shape", cfg.num_layers,
                        cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.vocab_size)
    graphs = None
    if device.startswith("cuda") and choice.backend in CAPTURABLE_BACKENDS:
        graphs = DecodeGraphs(model, caches, attn, bs, per_seq, num_blocks, device,
                              list(batches))

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    def step(chunks, n_ids, graphed=False):
        """One forward and the argmax's copy to the host, as an iteration does."""
        ids = torch.randint(3, cfg.vocab_size, (n_ids,))      # on the host, as a plan's are
        with torch.inference_mode():
            if graphed:
                logits = graphs.run(ids, chunks, graphs.size_for(chunks))
            else:
                meta = build_attention_metadata(chunks, bs, device, act)
                logits = model(ids.to(device), caches, meta, attn)
            return argmax(logits).cpu()

    def timed(b, graphed):
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        for _ in range(2):                               # warm-up (compiles the kernels)
            step([Chunk(1, context, t) for t in tables], b, graphed)
        sync()
        t0 = time.perf_counter()
        for s in range(steps):
            step([Chunk(1, context + s, t) for t in tables], b, graphed)
        sync()
        return (time.perf_counter() - t0) * 1e3 / steps

    rows = []
    for graphed in ([False, True] if graphs is not None else [False]):
        for b in batches:
            ms = timed(b, graphed)
            roof = estimate_iteration([(1, context)] * b, mshape, hw, 2).time_ms
            rows.append({"what": f"decode batch {b} at context {context}", "cuda_graphs": graphed,
                         "ms_per_step": ms, "tok_s": b * 1e3 / ms, "roofline_ms": roof,
                         "ratio_to_roofline": ms / roof})
    ablation = []
    if graphs is not None:
        # batch 1 with graphs again, each of the one-row decode's kernel choices
        # (docs/gpu.md#one-row-decode) switched from its default in turn, then all of them:
        # what each is worth on this GPU
        from contextlib import ExitStack
        from unittest import mock

        from gpu_worker.attention import triton_backend
        from gpu_worker.model import triton_gemv, triton_ops
        switches = {
            "cuBLAS for one row": lambda: mock.patch.object(triton_gemv, "serves",
                                                            lambda *a: False),
            "RoPE and the K/V store apart": lambda: mock.patch.object(
                attn, "rope_store_attend", None, create=True),
            "torch's argmax": lambda: mock.patch.object(triton_ops, "argmax_rows",
                                                        lambda x: x.argmax(-1)),
            "split merge in the attention kernel": lambda: mock.patch.object(
                triton_backend, "FUSED_COMBINE", not triton_backend.FUSED_COMBINE),
        }
        variants = [("defaults", [])] + [(k, [k]) for k in switches] + \
            [("all four", list(switches))]
        for rnd in range(2):                  # two rounds, alternating: the GPU drifts a little
            for name, changed in variants:
                with ExitStack() as stack:
                    for k in changed:
                        stack.enter_context(switches[k]())
                    graphs = DecodeGraphs(model, caches, attn, bs, per_seq, num_blocks,
                                          device, [1])
                    ms = timed(1, True)
                ablation.append({"switched": name, "round": rnd, "ms_per_step": ms})
                print(f"batch 1, graphs, {name}: {ms:.3f} ms", file=sys.stderr)
    profiles = {}
    if profile and device.startswith("cuda"):
        for b in (1, max(batches)):
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
            profiles[f"decode batch {b}, eager"] = _kernel_table(
                lambda: step([Chunk(1, context, t) for t in tables], b))
    table = list(range(-(-prefill // bs)))
    step([Chunk(prefill, prefill, table)], prefill)                         # warm-up
    sync()
    t0 = time.perf_counter()
    step([Chunk(prefill, prefill, table)], prefill)
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    roof = estimate_iteration([(prefill, prefill)], mshape, hw, 2).time_ms
    rows.append({"what": f"prefill {prefill}", "cuda_graphs": False, "ms_per_step": ms,
                 "tok_s": prefill * 1e3 / ms, "roofline_ms": roof, "ratio_to_roofline": ms / roof})
    for r in rows:
        print(f"{r['what']:>32} graphs={r['cuda_graphs']!s:5}: {r['ms_per_step']:9.2f} ms, "
              f"{r['tok_s']:10.1f} tok/s, {r['ratio_to_roofline']:8.2f}x the {hw_name} roofline",
              file=sys.stderr)
    return {"shape": shape, "dtype": "bfloat16", "attention_backend": choice.backend,
            "block_size": bs, "hardware": hw_name, "rows": rows, "ablation_batch_1": ablation,
            "kernel_profiles": profiles}


def _kernel_table(run, steps: int = 3) -> dict:
    """GPU time per step by kernel (torch.profiler), the largest first: where a step's time
    goes apart from the gaps between kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append((e.key, us / steps, e.count / steps))
    rows.sort(key=lambda r: -r[1])
    return {"kernel_us_per_step": round(sum(r[1] for r in rows), 1),
            "kernels_per_step": round(sum(r[2] for r in rows), 1),
            "top": [{"kernel": k[:100], "us": round(us, 1), "calls": round(c, 1)}
                    for k, us, c in rows[:20]]}


# ---- (c) served ---------------------------------------------------------------------------

def write_shape_dir(path: str, shape: dict) -> str:
    """A model directory for `--load-format dummy` (random weights, nothing else read): a
    config.json of `shape` and a word-level tokenizer with one word per id of the vocabulary,
    so every sampled id decodes to text and streams as its own event."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    os.makedirs(path, exist_ok=True)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, shape["vocab_size"])]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>"}, f)
    config = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama",
                  head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                  rope_theta=5e5, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def served(tmp: str, device: str) -> dict:
    """bench/served_vs_inprocess.py on the random Llama-3-8B-shaped model, concurrency 64."""
    import subprocess
    model = write_shape_dir(os.path.join(tmp, "llama3-8b-shape"), LLAMA3_8B_SHAPE)
    out = os.path.join(tmp, "served.json")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "bench", "served_vs_inprocess.py"),
           "--model", model, "--load-format", "dummy", "--device", device,
           "--dtype", "bfloat16", "--kv-cache-memory", "24GiB", "--max-num-seqs", "64",
           "--max-num-batched-tokens", "4096", "--concurrency", "64", "--num-prompts", "192",
           "--output-len", "128", "--repeats", "2", "--json", out]
    print("served:", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=root, timeout=300, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-6000:], file=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"served_vs_inprocess.py exited with {proc.returncode}:\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    return {"command": "python bench/served_vs_inprocess.py " + " ".join(cmd[3:-2]),
            "summary": result["summary"], "rows": result["rows"]}


if __name__ == "__main__":
    sys.exit(main())
