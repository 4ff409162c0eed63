"""The quantized GEMMs by rows: each path gpu_worker/quant/linear.py can take, timed on the
default model's shapes, to set where one path hands over to the next (`amx_rows`, `dpbf16_rows`, `fma_rows`,
`many_rows`, `vnni_amx_rows`).

Per row count, the whole model's layer GEMMs (30 layers x qkv, o, gate_up, down as int4, each
a distinct weight so that they stream from memory as in a forward) and the LM head (int8,
49152 x 576), best of 5, ms:

    aten    torch's int4 / int8 kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
    widen   the weight widened to bfloat16 in memory, then torch's bf16 GEMM
    amx     widened in cache and multiplied on AMX tiles (`int4pack_mm_amx`, `int8_mm_amx`)
    dpbf16  widened in cache and multiplied with AVX512-BF16's `vdpbf16ps`
            (`int4pack_mm_dpbf16`, `int8_mm_dpbf16`: AVX512-BF16 without AMX)
    fma     widened to float32 in cache and multiplied with FMA (`int4pack_mm_fma`,
            `int8_mm_fma`): CPUs with neither AMX nor native bf16 (AVX2); to see it on an
            AVX-512 machine, hold everything at AVX2: PACER_CPU_ISA=avx2
            ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
    vnni    int4 only: the codes in the VNNI layout, x quantized to 8 bits per block of 32,
            `vpdpbusd` (`int4_mm_vnni`: AVX512-VNNI or AVX2, every row count)
    vnni_amx  the VNNI layout widened in cache and multiplied on AMX tiles (`int4vnni_mm_amx`,
            what AMX CPUs take from `vnni_amx_rows` rows on)
    bf16    for scale: the same GEMMs on prepacked bfloat16 weights (`--quantization none`)

    python bench/quant_gemms.py [--rows 1,4,8,10,16,24,32,64,128,512] [--json out.json]

With `--in-cache`: the VNNI kernels' arithmetic alone, on one thread, each shape's one weight
multiplied 20 times in a row so that it stays in cache; GMAC/s per shape and row count (what
docs/benchmarks.md#integer-gemms-without-a-division-or-a-spill compares between builds).

    python bench/quant_gemms.py --in-cache [--rows 4,32,128]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import best_ms, print_table, write_json  # noqa: E402
import torch  # noqa: E402

from gpu_worker.model.layers import prepack  # noqa: E402
from gpu_worker.quant import linear  # noqa: E402
from gpu_worker.quant.linear import Int4Weight, Int8Weight  # noqa: E402
from gpu_worker.quant.tensor import QTensor, quantize_int8  # noqa: E402
from shared.cpu import cpu_flags  # noqa: E402

LAYERS = 30
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def random_int4(n: int, k: int, group: int = 32) -> QTensor:
    return QTensor("int4", torch.randint(0, 16, (n, k), dtype=torch.uint8),
                   torch.rand(n, k // group) * 0.01, torch.rand(n, k // group) * 0.01, group)


THRESHOLDS = ("many_rows", "amx_rows", "dpbf16_rows", "fma_rows")


def forced(path: str) -> dict[str, int]:
    """Row thresholds that send every size down `path`."""
    never, always = 10 ** 9, 0
    chosen = {"aten": None, "widen": "many_rows", "amx": "amx_rows", "dpbf16": "dpbf16_rows",
              "fma": "fma_rows"}[path]
    return {name: always if name == chosen else never for name in THRESHOLDS} | \
        {"dpbf16_max_rows": None}


def vnni_mm(w: Int4Weight, x: torch.Tensor, kernel: str) -> torch.Tensor:
    y = x.new_empty((x.shape[0], w.padded_out))
    getattr(linear._vnni_kernels(), kernel)(x, w.vnni, w.group, y)
    return y


def hot_gmacs(rows: list[int]) -> list[dict]:
    """GMAC/s of `int4_mm_vnni` on each layer shape and of `int8_mm_vnni` on the LM head, one
    thread, the weight hot in cache."""
    torch.set_num_threads(1)
    weights = {name: Int4Weight(random_int4(*shape), vnni=True)
               for name, shape in LAYER_SHAPES.items()}
    head = Int8Weight(quantize_int8(torch.randn(*LM_HEAD) * 0.02))
    assert head.vnni is not None, "no VNNI-order int8 here"
    # (weight, its product, calls a timing): the LM head is large, a few calls fill the time
    products = {name: (w, lambda w, x: vnni_mm(w, x, "int4_mm_vnni"), 20)
                for name, w in weights.items()}
    products["lm_head"] = (head, lambda w, x: w.mm(x, torch.float32), 3)
    out = []
    for m in rows:
        row: dict = {"rows": m}
        for name, (w, product, calls) in products.items():
            x = torch.randn(m, w.in_features, dtype=torch.bfloat16)
            ms = best_ms(lambda: [product(w, x) for _ in range(calls)])
            row[f"{name}_gmac_s"] = m * w.out_features * w.in_features * calls / ms / 1e6
        out.append(row)
        print(f"rows {m}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "rows"),
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,10,16,24,32,64,128,512")
    ap.add_argument("--in-cache", action="store_true",
                    help="the VNNI kernels alone, one thread, weights in cache: GMAC/s")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.in_cache:
        if linear._vnni_kernels() is None:
            sys.exit("no VNNI kernels here (AVX512-VNNI or an avx2 build)")
        rows_out = hot_gmacs([int(r) for r in args.rows.split(",")])
        report(rows_out, args.json)
        return
    codes = {name: [random_int4(*shape) for _ in range(LAYERS)]
             for name, shape in LAYER_SHAPES.items()}
    layers = {name: [Int4Weight(q, vnni=False) for q in qs] for name, qs in codes.items()}
    vnni = [Int4Weight(q, vnni=True) for qs in codes.values() for q in qs] \
        if linear._vnni_kernels() is not None else None
    head = Int8Weight(quantize_int8(torch.randn(*LM_HEAD) * 0.02))
    bf16 = [prepack(torch.randn(shape, dtype=torch.bfloat16))
            for shape in LAYER_SHAPES.values() for _ in range(LAYERS)]
    bf16_head = prepack(torch.randn(LM_HEAD, dtype=torch.bfloat16))
    in_cache = linear._in_cache_kernels()[1]      # the in-cache kind this CPU takes, if any
    paths = ["aten", "widen"] + ([in_cache] if in_cache else [])
    saved = {cls: {name: getattr(cls, name) for name in (*THRESHOLDS, "dpbf16_max_rows")}
             for cls in (Int4Weight, Int8Weight)}
    rows_out = []
    try:
        for rows in (int(r) for r in args.rows.split(",")):
            row = {"rows": rows}
            xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
            for path in paths:
                for cls in (Int4Weight, Int8Weight):
                    for name, value in forced(path).items():
                        setattr(cls, name, value)
                row[f"{path}_layers_ms"] = best_ms(lambda: [
                    w.mm(xs[w.in_features]) for ws in layers.values() for w in ws])
                row[f"{path}_head_ms"] = best_ms(lambda: head.mm(xs[576]))
            for name, kernel in (("vnni", "int4_mm_vnni"), ("vnni_amx", "int4vnni_mm_amx")):
                if vnni is not None and (name == "vnni" or linear._amx_kernels() is not None):
                    row[f"{name}_layers_ms"] = best_ms(lambda: [
                        vnni_mm(w, xs[w.in_features], kernel) for w in vnni])
            row["bf16_layers_ms"] = best_ms(lambda: [
                torch.ops.mkldnn._linear_pointwise(xs[576 if i < 3 * LAYERS else 1536], w, None,
                                                   "none", [], "")
                for i, w in enumerate(bf16)])
            row["bf16_head_ms"] = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(
                xs[576], bf16_head, None, "none", [], ""))
            rows_out.append(row)
            print(f"rows {rows}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()
                                               if k != "rows"), flush=True)
    finally:
        for cls, values in saved.items():
            for name, value in values.items():
                setattr(cls, name, value)
    report(rows_out, args.json)


def report(rows_out: list[dict], json_path: str | None) -> None:
    flags = " ".join(f for f in SHOWN_FLAGS if f in cpu_flags())
    held = os.environ.get("PACER_CPU_ISA")
    flags += f" (kernels held at {held})" if held else ""
    print(f"\nCPU flags: {flags}; torch threads {torch.get_num_threads()}")
    print_table(rows_out, list(rows_out[0]))
    write_json(json_path, {"cpu_flags": flags, "threads": torch.get_num_threads(),
                           "rows": rows_out})


if __name__ == "__main__":
    main()
