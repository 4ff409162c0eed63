"""Every Triton kernel of the GPU path compiled for real GPUs (Hopper sm_90, Ampere sm_80) on
this CPU machine, down to machine code with the ptxas that ships in Triton's wheel.

The interpreter (TRITON_INTERPRET=1, the other Triton tests) checks what the kernels compute,
but never lowers them: a construct the compiler rejects (a layout it cannot convert, an atomic
in a branch, a 3-D reduction) would first fail on a GPU. No GPU is needed to compile. The
compiles run in a process of their own: the test session imported the kernels interpreted."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton, in the dev extra)",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compile(fn, target, pointers: dict[str, str], constexprs: dict, floats=()):
    """fn for `target`: pointer arguments typed as given, `floats` float32, the rest int32."""
    import triton
    from triton.compiler import ASTSource
    while not hasattr(fn, "params"):                    # an autotuner wraps the kernel
        fn = fn.fn
    signature = {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name in pointers:
            signature[p.name] = "*" + pointers[p.name]
        else:
            signature[p.name] = "fp32" if p.name in floats else "i32"
    return triton.compile(ASTSource(fn, signature, constexprs), target=target)


def _attention_pointers(dtype: str) -> dict[str, str]:
    return dict(Q=dtype, K=dtype, V=dtype, O=dtype, cu_seqlens_q="i32", kv_lens="i64",
                block_table="i32", part_m="fp32", part_l="fp32", part_acc="fp32",
                counters="i32")


def _cases():
    """(name, kernel, pointer types, constexprs, float arguments) for every kernel."""
    from gpu_worker.attention import triton_backend as tb
    from gpu_worker.model import triton_gemv, triton_ops as ops
    b16 = "bf16"
    for split, fused, dtype in [(False, False, b16), (True, False, b16), (True, True, b16),
                                (True, True, "fp32")]:
        yield (f"paged attention split={split} merged in kernel={fused} {dtype}",
               tb._paged_attention_kernel, _attention_pointers(dtype),
               dict(BLOCK_Q=4, GROUP_P=4, BLOCK_N=64, BLOCK_D=128, IEEE=dtype == "fp32",
                    UPCAST=False, SPLIT=split, FUSED_COMBINE=fused), ("scale_log2",))
    yield ("split merge", tb._combine_splits_kernel,
           dict(O=b16, part_m="fp32", part_l="fp32", part_acc="fp32", kv_lens="i64"),
           dict(BLOCK_S=128, BLOCK_D=128), ())
    yield ("rope", ops._rope_kernel, dict(X=b16, positions="i64", cos="fp32", sin="fp32"),
           dict(BLOCK_H=64, BLOCK_HALF=64), ())
    yield ("rope + K/V store", ops._rope_store_kernel,
           dict(QKV=b16, positions="i64", slots="i64", cos="fp32", sin="fp32", K=b16, V=b16),
           dict(BLOCK_H=64, BLOCK_KV=8, BLOCK_HALF=64), ())
    yield ("add + rms norm", ops._add_rms_norm_kernel, dict(X=b16, D=b16, W=b16, Out=b16),
           dict(BLOCK=4096), ("eps",))
    yield ("silu and mul", ops._silu_and_mul_kernel, dict(GU=b16, H=b16), dict(BLOCK=1024), ())
    yield ("argmax parts", ops._argmax_part_kernel, dict(X="fp32", part_v="fp32", part_i="i32"),
           dict(BLOCK=ops.ARGMAX_BLOCK), ())
    yield ("argmax merge", ops._argmax_merge_kernel,
           dict(part_v="fp32", part_i="i32", out="i64"), dict(BLOCK_P=32), ())
    for config in triton_gemv._CONFIGS:
        yield (f"one-row GEMM {config.kwargs}", triton_gemv._gemv_kernel,
               dict(X=b16, W=b16, Y=b16), config.kwargs, ())


ARCHS = (90, 80)


def main(arch: int) -> None:
    """In a process without TRITON_INTERPRET: compile every case for sm_`arch` and print
    {case: "ok" or the error} as JSON."""
    from triton.backends.compiler import GPUTarget
    target, results = GPUTarget("cuda", arch, 32), {}
    for name, fn, pointers, constexprs, floats in _cases():
        try:
            ok = bool(_compile(fn, target, pointers, constexprs, floats).asm["cubin"])
            results[name] = "ok" if ok else "no machine code"
        except Exception as e:                           # reported per case by the test
            results[name] = f"{type(e).__name__}: {e}"[:2000]
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled() -> dict:
    """{"sm_N": results}: one process per target, side by side."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {f"sm_{arch}": subprocess.Popen(
        [sys.executable, "-c", f"from tests.test_triton_compile import main; main({arch})"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for arch in ARCHS}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("arch", [f"sm_{a}" for a in ARCHS])
def test_every_gpu_kernel_compiles(compiled, arch):
    failed = {name: r for name, r in compiled[arch].items() if r != "ok"}
    assert not failed, failed
    assert len(compiled[arch]) >= 13
