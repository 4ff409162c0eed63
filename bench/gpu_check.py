"""The prepared GPU check (issue 14; docs/gpu.md), one JSON file out:

  (a) parity: a tiny random Llama, greedy tokens on the device (float32, TF32 off) equal to the
      CPU float32 reference path; bfloat16 top-1 agreement with the float32 reference over a
      teacher-forced sequence (1k positions; 128 in smoke mode).
  (b) speed: a random-weight model of Llama-3-8B's shape (a small one in smoke mode), in-process
      decode tok/s at a few batch sizes and one long prefill, each beside the roofline of
      `pacer cost` for the same shape and hardware (the ratio is the figure that matters).

    python -m bench.gpu_check --device cuda --out docs/gpu_check.json     # on a GPU
    python -m bench.gpu_check --device cpu --out /tmp/smoke.json          # smoke mode (CI)

Smoke mode (--device cpu) runs the same code on tiny shapes so that the script is not broken
when a GPU arrives; there the device under test runs our Triton kernel under TRITON_INTERPRET=1
(when triton is installed), so (a) compares it with the torch path end to end. Its speed
figures mean nothing. The served path at concurrency 64 and CUDA graphs are not part of this
script yet (the JSON says so).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

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
    ap.add_argument("--skip-speed", action="store_true", help="only (a)")
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
                    "cuda_graphs": "not implemented yet (docs/gpu.md)",
                    "served": "not part of this script yet (bench/served_vs_inprocess.py)"}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report["parity"] = parity(tmp, args.device, backend, smoke)
    if not args.skip_speed:
        # smoke mode times the torch path: the interpreter's speed says nothing
        report["speed"] = speed(args.device, "torch" if smoke else backend, smoke, args.hw)
    report["seconds"] = round(time.perf_counter() - started, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    p = report["parity"]
    ok = p["greedy_equal"] and p["bf16_top1_agreement"] >= p["bf16_threshold"]
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


def _teacher_forced_top1(engine, ids: list[int]):
    """argmax of every position of one prefill of `ids`: [len(ids)] on the host."""
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
    return logits.argmax(-1).cpu()


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
    ref_top1 = _teacher_forced_top1(ref, forced)
    ref.shutdown()

    dut = _engine(model, device, "float32", backend)
    dut_tokens = _greedy(dut, prompts, steps)
    dut.shutdown()
    # bf16 on the device (on CPU the residual stream stays float32: shared/config.py)
    bf = _engine(model, device, "bfloat16", backend)
    bf_top1 = _teacher_forced_top1(bf, forced)
    bf.shutdown()
    return {"prompts": len(prompts), "greedy_steps": steps,
            "greedy_equal": dut_tokens == ref_tokens,
            "first_mismatch": next(([i, j] for i, (a, b) in enumerate(zip(dut_tokens, ref_tokens))
                                    for j, (x, y) in enumerate(zip(a, b)) if x != y), None),
            "bf16_positions": positions,
            "bf16_top1_agreement": float((bf_top1 == ref_top1).float().mean()),
            # a tiny random model's logits are close together: the smoke run's bar is lower
            "bf16_threshold": 0.95 if smoke else 0.99}


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
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.fill_(1.0) if pname.endswith("norm.weight") else p.normal_(0, 0.02)
    fused = None
    if device == "cpu" and dtype != act:
        from gpu_worker.cpu_kernels import cpu_kernels
        fused = cpu_kernels()
    model.set_dtypes(dtype, act, fused)
    return cfg, model.eval(), act


def speed(device: str, backend: str, smoke: bool, hw_name: str) -> dict:
    import torch
    from gpu_worker.attention import Chunk, build_attention_metadata, select_backend
    from gpu_worker.kv_cache import allocate_kv_cache
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
    per_seq = -(-max(context + steps + 8, prefill) // bs)
    num_blocks = max(batches) * per_seq
    caches = allocate_kv_cache(cfg, num_blocks, bs, cfg.num_kv_heads, dtype, device)
    hw = load_hardware(hw_name)
    mshape = ModelShape("llama-3-8b-shape" if not smoke else "smoke-shape", cfg.num_layers,
                        cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.vocab_size)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    def step(chunks, n_ids):
        meta = build_attention_metadata(chunks, bs, device, act)
        ids = torch.randint(3, cfg.vocab_size, (n_ids,), device=device)
        with torch.inference_mode():
            return model(ids, caches, meta, attn).argmax(-1).cpu()

    rows = []
    for b in batches:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        for _ in range(2):                                   # warm-up (compiles the kernels)
            step([Chunk(1, context, t) for t in tables], b)
        sync()
        t0 = time.perf_counter()
        for s in range(steps):
            step([Chunk(1, context + s, t) for t in tables], b)
        sync()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        roof = estimate_iteration([(1, context)] * b, mshape, hw, 2).time_ms
        rows.append({"what": f"decode batch {b} at context {context}", "ms_per_step": ms,
                     "tok_s": b * 1e3 / ms, "roofline_ms": roof, "ratio_to_roofline": ms / roof})
    step([Chunk(prefill, prefill, list(range(per_seq)))], prefill)           # warm-up
    sync()
    t0 = time.perf_counter()
    step([Chunk(prefill, prefill, list(range(per_seq)))], prefill)
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    roof = estimate_iteration([(prefill, prefill)], mshape, hw, 2).time_ms
    rows.append({"what": f"prefill {prefill}", "ms_per_step": ms, "tok_s": prefill * 1e3 / ms,
                 "roofline_ms": roof, "ratio_to_roofline": ms / roof})
    for r in rows:
        print(f"{r['what']:>32}: {r['ms_per_step']:9.2f} ms, {r['tok_s']:10.1f} tok/s, "
              f"{r['ratio_to_roofline']:8.2f}x the {hw_name} roofline", file=sys.stderr)
    return {"shape": shape, "dtype": "bfloat16", "attention_backend": choice.backend,
            "block_size": bs, "hardware": hw_name, "cuda_graphs": False, "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
