"""One row times a 16-bit weight matrix on a GPU, in Triton, where it beats cuBLAS
(docs/gpu.md#one-row-decode).

A decode step of one stream reads every weight once for one row: the GEMMs are pure
bandwidth. On an H200 cuBLAS read the two large matrices of a Llama-3-8B layer (gate/up,
down) at ~4.0 TB/s but the two small ones (QKV 4096×6144, O 4096×4096) at ~3.1–3.3 TB/s,
and split the O and down products over K with a second kernel to add the parts.

This kernel gives each program BLOCK_N rows of W and walks K in BLOCK_K steps, multiplying
in float32 and summing once at the end; Triton's autotuner picks the tile per matrix shape.
Whether it serves a shape at all is measured, not assumed: the first product of each shape
times both (`linear`) and keeps the faster, so a GPU where cuBLAS wins keeps cuBLAS. The
decision is made outside any CUDA-graph capture (the capture's eager warm-up comes first);
a shape first met while capturing takes cuBLAS.
"""
from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

log = structlog.get_logger("worker")

_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in [(4, 512, 4, 1), (4, 1024, 4, 1), (8, 512, 4, 1),
                                  (8, 1024, 8, 1), (16, 512, 8, 1), (4, 512, 4, 3),
                                  (8, 512, 4, 3), (8, 256, 4, 4), (16, 256, 4, 3),
                                  (2, 1024, 4, 3)]]


@triton.jit
def _gemv_kernel(X, W, Y, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    rows = W + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        x = tl.load(X + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(Y + n, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=n_ok)


_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K"])(_gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int] | None = None
         ) -> torch.Tensor:
    """x [1, K] times weight [N, K]ᵀ -> [1, N] in the weight's dtype, float32 inside. `tile`
    (BLOCK_N, BLOCK_K) skips the autotuner (Triton's interpreter, on CPU, has none)."""
    N, K = weight.shape
    assert x.shape == (1, K) and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty((1, N), dtype=weight.dtype, device=weight.device)
    if tile is not None:
        _gemv_kernel[(triton.cdiv(N, tile[0]),)](x, weight, y, N, K, weight.stride(0),
                                                 BLOCK_N=tile[0], BLOCK_K=tile[1])
    else:
        _tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](x, weight, y, N, K,
                                                                weight.stride(0))
    return y


# (N, K, dtype, device) -> whether gemv serves that shape
_faster: dict[tuple, bool] = {}


def _time(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` serves this product: one row, 16-bit operands on a GPU, and measured
    faster than cuBLAS for this weight shape (timed once per shape, never while capturing)."""
    if x.shape[0] != 1 or x.stride(-1) != 1 or not weight.is_cuda or \
            weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    key = (*weight.shape, weight.dtype, weight.device)
    if key not in _faster:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            ours = _time(lambda: gemv(x, weight))        # the first call also autotunes
        except Exception as e:                            # e.g. a GPU Triton cannot build for
            log.warning("one-row gemm: cuBLAS serves", shape=list(weight.shape),
                        error=f"{type(e).__name__}: {e}"[:500])
            _faster[key] = False
            return False
        theirs = _time(lambda: F.linear(x, weight))
        _faster[key] = ours < theirs
        log.info("one-row gemm", shape=list(weight.shape), triton_us=round(ours * 1e3, 1),
                 cublas_us=round(theirs * 1e3, 1), serves="triton" if ours < theirs else "cublas")
    return _faster[key]
