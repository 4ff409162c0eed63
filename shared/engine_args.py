"""The engine flags every entry point shares (`pacer generate`, `pacer up`, `pacer scheduler`,
`pacer worker`), parsed once into a frozen value."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace

from shared.attention_choice import BACKENDS, choose_attention_here
from shared.cpu import auto_dtype
from shared.config import (AUTO_TBT_TEXT, AUTO_TTFT_FACTOR, DEFAULT_BLOCK_SIZE, DEFAULT_KV_CACHE_MEMORY,
                           DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS)
from shared.errors import PacerError


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    # auto: a GGUF in the precision it ships (int4 for 4 bits or fewer, int8 for more), a float
    # checkpoint as it is; none: every weight widened to --dtype (gpu_worker/quant)
    quantization: str = "auto"
    device: str = "cpu"
    tp: int = 1
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    num_kv_blocks: int | None = None
    # None: DEFAULT_KV_CACHE_MEMORY on CPU; on CUDA the pool is sized from
    # gpu_memory_utilization (see services/engine.py engine_layout)
    kv_cache_memory: str | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int | None = None         # None: the attention backend's default
    attention_backend: str = "auto"
    # dummy: random weights made on the device, no checkpoint read (benchmarks of a model's
    # shape, e.g. bench/gpu_check.py); auto: read the checkpoint
    load_format: str = "auto"
    cuda_graphs: bool = True              # CUDA: decode iterations replay captured graphs
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_iteration_ms: float | None = None
    # "auto", "off" or ms; the in-process engine's default is off (offline: no one waits
    # between tokens), the serving commands' is auto
    target_tbt_ms: str = "off"
    # "auto", "off" or ms: the TTFT goal of a P/D prefill instance (other roles ignore it)
    target_ttft_ms: str = "auto"
    hw: str | None = None
    seed: int | None = None
    # ---- P/D: the KV connector a worker moves K/V with (gpu_worker/kv_transfer,
    # docs/architecture.md#kv-transfer); `none` refuses plans that send K/V ----
    kv_connector: str = "none"
    kv_host: str = "127.0.0.1"
    kv_protocol: str = "tcp"
    kv_device: str = ""
    kv_timeout_s: float = 10.0

    @staticmethod
    def add_kv_cli_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--kv-connector", default="none", choices=["none", "mooncake"],
                       help="P/D: what moves K/V between a prefill and a decode instance: "
                            "mooncake (the Mooncake transfer engine) or none (default)")
        p.add_argument("--kv-host", default="127.0.0.1",
                       help="P/D: the host name or IP address peers reach this worker's KV "
                            "transfer engine at, without a port (the engine picks its ports and "
                            "listens on every interface: firewall them)")
        p.add_argument("--kv-protocol", default="tcp",
                       help="P/D: the transfer engine's protocol: tcp (default) or rdma")
        p.add_argument("--kv-device", default="",
                       help="P/D: RDMA devices for the transfer engine, comma-separated "
                            "(default: all it finds)")
        p.add_argument("--kv-timeout-s", type=float, default=10.0,
                       help="P/D: how long an iteration waits for its K/V sends before it "
                            "reports them failed")
    # ---- end of the KV connector's part ----

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser,
                     budget: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, target_tbt: str = "auto") -> None:
        p.add_argument("--model", default=None,
                       help="smollm2-135m (default), an HF directory, or a .gguf file")
        p.add_argument("--dtype", default="auto",
                       choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight dtype; auto (default): bfloat16 on CUDA and on CPUs with "
                            "native bf16 (AVX512-BF16/AMX), float32 on other CPUs; "
                            "float16 on CUDA only")
        p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                       help="weights as integers on CPU: auto (default) serves a GGUF in its own "
                            "precision (int4 for Q4_0/Q4_1/Q4_K and narrower, int8 where Q8_0, Q6_K "
                            "or another wider type is among its matrices) and a float checkpoint "
                            "as is; int8/int4 quantize at load; none widens every weight to --dtype")
        p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
        p.add_argument("--max-num-batched-tokens", type=int, default=budget,
                       help="token budget: most Q rows in one iteration")
        p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                       help="most requests running at once")
        p.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV blocks per layer (overrides --kv-cache-memory)")
        p.add_argument("--kv-cache-memory", default=None,
                       help=f"memory for the KV block pool per rank, e.g. 2GiB (default: "
                            f"{DEFAULT_KV_CACHE_MEMORY} on CPU; on CUDA what "
                            f"--gpu-memory-utilization leaves)")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="CUDA: the share of the GPU's memory the worker may use; the KV "
                            "pool gets what the weights and a forward's activations leave")
        p.add_argument("--block-size", type=int, default=None,
                       help=f"tokens per KV block (default: {DEFAULT_BLOCK_SIZE}; 256 with "
                            f"flash-attn, whose paged KV needs a multiple of 256)")
        p.add_argument("--attention-backend", default="auto", choices=BACKENDS,
                       help="auto (default): flash-attn on CUDA when installed, else our "
                            "Triton kernel; torch (+ C++ kernels) on CPU")
        p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="auto (default): read the checkpoint; dummy: random weights of the "
                            "model's shape, for benchmarks (needs only its config.json)")
        p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                       help="CUDA: run decode iterations eagerly instead of replaying "
                            "captured CUDA graphs (docs/gpu.md#cuda-graphs)")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the model's)")
        p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false", help="whole prompts in one iteration (ORCA only)")
        p.add_argument("--target-tbt-ms", default=target_tbt, type=parse_latency_target,
                       help=f"token-gap target while decodes run: auto ({AUTO_TBT_TEXT}), "
                            "off, or ms; caps the prefill rows that ride along, by the "
                            "iteration-cost model fitted online from measured forward times")
        p.add_argument("--target-ttft-ms", default="auto", type=parse_latency_target,
                       help=f"P/D prefill instances: the time-to-first-token goal the prefill "
                            f"scheduler orders prompts by (earliest deadline first) and sizes "
                            f"iterations to; auto (default): {AUTO_TTFT_FACTOR:g}x the prompt's "
                            f"own predicted prefill plus one full-budget iteration; off (first "
                            f"come, first served) or ms")
        p.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                       action="store_false",
                       help="never reuse the K/V of a prefix another request computed")
        p.add_argument("--max-iteration-ms", type=float, default=None,
                       help="a fixed latency budget for every iteration, decodes or not: cut each "
                            "prefill chunk to what the cost model says fits")
        p.add_argument("--hw", default=None,
                       help="use the roofline of this hardware profile (h100, h200, a100, or a "
                            "JSON written by `pacer calibrate`) instead of the online fit")
        p.add_argument("--seed", type=int, default=None, help="seed for unseeded sampling")
        EngineArgs.add_kv_cli_args(p)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)
                      if hasattr(args, f.name)}).resolved()

    @classmethod
    def serving(cls, **changes) -> "EngineArgs":
        """What `pacer up` runs with when given no engine flag, with `changes` (the dataclass's
        own defaults are the in-process engine's: no token-gap target)."""
        p = argparse.ArgumentParser()
        cls.add_cli_args(p)
        return replace(cls.from_cli(p.parse_args([])), **changes)

    def resolved(self) -> "EngineArgs":
        """`auto` replaced by the dtype this machine serves fastest in, the attention backend
        and block size decided (shared/attention_choice.py; an error for a pair that cannot
        run here), the KV memory defaulted on CPU."""
        args = self if self.dtype != "auto" else replace(self, dtype=auto_dtype(self.device))
        if args.dtype == "float16" and not args.device.startswith("cuda"):
            # the CPU's fused norm, RoPE and SwiGLU kernels take bfloat16 or float32 only: a
            # float16 model would load and then fail at its first forward
            raise PacerError("--dtype float16 is not served on CPU: use --dtype bfloat16 "
                             "(the same bytes per weight) or float32")
        choice = choose_attention_here(args.attention_backend, args.device, args.dtype,
                                       args.block_size)
        args = replace(args, attention_backend=choice.backend, block_size=choice.block_size)
        if args.kv_cache_memory is None and not args.device.startswith("cuda"):
            args = replace(args, kv_cache_memory=DEFAULT_KV_CACHE_MEMORY)
        if not 0 < args.gpu_memory_utilization <= 1:
            raise PacerError(f"--gpu-memory-utilization must be in (0, 1], "
                             f"got {args.gpu_memory_utilization}")
        return args


def parse_latency_target(text: str) -> str:
    if text in ("auto", "off"):
        return text
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not (ms > 0 and ms != float("inf")):
        raise argparse.ArgumentTypeError(f"auto, off or a positive number of ms, got {text!r}")
    return text
