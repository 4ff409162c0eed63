"""The cost model's GEMM efficiency curve and KV capacity, from plain numbers
(docs/design.md#small-chunks-run-below-peak, docs/design.md#the-memory-wall)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from shared.cost_model import (MODELS, ModelShape, RooflineCost, estimate_iteration,
                               kv_capacity)
from shared.errors import PacerError
from shared.hardware import HARDWARE, HardwareProfile, hardware_from_dict

# One layer of a 10x10 linear and nothing else worth counting: FLOPs by hand.
TINY = ModelShape("tiny", num_layers=1, hidden_size=10, intermediate_size=10, num_heads=1,
                  num_kv_heads=1, head_dim=10, vocab_size=10, tie_word_embeddings=True)
# 1 GFLOP/s (1e-3 TFLOP/s) and a bandwidth so high that every iteration is compute-bound.
FLAT = HardwareProfile("flat", {"bfloat16": 1e-3}, bandwidth_tbps=1e6)
CURVED = replace(FLAT, name="curved", gemm_half_rows=32.0)


def gemm_efficiency(hw: HardwareProfile, rows: int) -> float:
    """The curve as docs/design.md#small-chunks-run-below-peak states it: a GEMM over `rows`
    rows reaches rows / (rows + r½) of the rate."""
    return rows / (rows + hw.gemm_half_rows)


def test_a_chunk_of_m_rows_runs_at_m_over_m_plus_r_half():
    # TINY's linears: per row 2 · (4·10·10 + 3·10·10) = 1,400 FLOPs through the layer, and the
    # sampling row's LM head 2 · 10 · 10 = 200; one 64-row chunk over no prefix.
    rows = 64
    flat = estimate_iteration([(rows, rows)], TINY, FLAT)
    curved = estimate_iteration([(rows, rows)], TINY, CURVED)
    assert flat.linear_flops == curved.linear_flops == 1400 * rows + 200
    attention_ms = flat.attention_flops / 1e9 * 1e3
    layer_ms = 1400 * rows / 1e9 * 1e3 / gemm_efficiency(CURVED, rows)   # the layer at M = 64
    head_ms = 200 / 1e9 * 1e3 / gemm_efficiency(CURVED, 1)               # the LM head at M = 1
    assert curved.compute_ms == pytest.approx(layer_ms + head_ms + attention_ms, rel=1e-12)
    assert curved.gemm_efficiency == pytest.approx(
        flat.linear_flops / (flat.linear_flops + 32 * (1400 + 200)), rel=1e-12)
    assert flat.gemm_efficiency == 1.0


def test_small_chunks_cost_more_per_row():
    def linear_ms_per_row(m: int) -> float:
        cost = estimate_iteration([(m, m)], TINY, CURVED)
        return (cost.compute_ms - cost.attention_flops / 1e9 * 1e3) / m

    per_row = [linear_ms_per_row(m) for m in (8, 64, 512)]
    assert per_row[0] > per_row[1] > per_row[2]
    assert per_row[0] / per_row[2] > 3          # (8 + 32) / 8 against (512 + 32) / 512
    flat = [estimate_iteration([(m, m)], TINY, FLAT).linear_flops / m for m in (8, 64, 512)]
    assert flat[0] > flat[2]                  # only the LM head's one row, shared out


def test_the_curve_shrinks_what_fits_a_budget():
    model = MODELS["llama-2-7b"]
    decodes = [(1, 1024)] * 8
    flat = RooflineCost(model, replace(HARDWARE["h100"], gemm_half_rows=0.0))
    curved = RooflineCost(model, HARDWARE["h100"])
    assert curved.max_prefill_rows(20.0, decodes, 0) < flat.max_prefill_rows(20.0, decodes, 0)
    # a pure decode iteration stays bound by reading the weights
    assert curved.iteration_ms(decodes) == flat.iteration_ms(decodes)


def test_profile_fields_round_trip_and_are_checked():
    hw = hardware_from_dict(CURVED.to_dict() | {"memory_gib": 24})
    assert hw.gemm_half_rows == 32.0 and hw.memory_gib == 24
    old = hardware_from_dict({"tflops": 1.0, "bandwidth_tbps": 0.05})
    assert old.gemm_half_rows == 0.0 and old.memory_gib is None
    for bad in ({"gemm_half_rows": -1}, {"memory_gib": 0}):
        with pytest.raises(PacerError):
            hardware_from_dict({"tflops": 1.0, "bandwidth_tbps": 0.05} | bad)
    # JSON's true read as 1; measurements of a list came out as a TypeError's traceback
    for bad, match in (({"bandwidth_tbps": True}, "bandwidth_tbps must be a positive number"),
                       ({"tflops": {"bfloat16": True}}, r"tflops\[bfloat16\] must be a positive"),
                       ({"memory_gib": True}, "memory_gib must be a positive number"),
                       ({"measurements": [1, 2]}, "'measurements' must be an object, got list")):
        with pytest.raises(PacerError, match=match):
            hardware_from_dict({"tflops": {"bfloat16": 1.0}, "bandwidth_tbps": 0.05} | bad)


# ---- the KV capacity ---------------------------------------------------------------------

def test_kv_capacity_by_hand():
    # 10 GiB at 0.9: 9 GiB, less the weights, one forward's activations and 2 GiB for CUDA
    # (its context, and nvidia-smi's total above what CUDA hands out).
    gib = 2**30
    hw = replace(FLAT, memory_gib=10.0)
    cap = kv_capacity(TINY, hw, dtype_bytes=2, utilization=0.9, max_num_batched_tokens=8,
                      max_num_seqs=2)
    weights = (700 + 100 + 3 * 10) * 2                       # layer, tied table, norms
    activations = 8 * (6 * 10 + 3 * 10 + 3 * 10) * 2 + 3 * 2 * 10 * 4
    assert cap.weight_bytes == weights and cap.activation_bytes == activations
    assert cap.kv_bytes == int(9 * gib) - weights - activations - 2 * gib
    assert cap.kv_bytes_per_token == 2 * 1 * 1 * 10 * 2
    assert cap.tokens == cap.kv_bytes // 40
    assert cap.sequences(1000) == cap.tokens // 1000


def test_the_memory_wall_of_llama_2_7b_on_an_h100():
    # 80 GiB · 0.9 less ~12.6 GiB of fp16 weights: ~58 GiB of K/V at 512 KiB a token, ~119k
    # tokens. At a 16k context that is 7 requests, far from the 32 a decode batch would want.
    cap = kv_capacity(MODELS["llama-2-7b"], HARDWARE["h100"])
    assert 57 * 2**30 < cap.kv_bytes < 60 * 2**30
    assert 110_000 < cap.tokens < 122_000
    assert cap.sequences(16 * 1024) == 7
    assert cap.sequences(1024) > 100
    # GQA pushes the wall back: a quarter of the bytes per token, about four times the tokens
    gqa = kv_capacity(MODELS["llama-3-8b"], HARDWARE["h100"])
    assert gqa.tokens > 3.5 * cap.tokens
    # H200's 141 GiB nearly doubles it (the weights take the same share out of more)
    assert kv_capacity(MODELS["llama-2-7b"], HARDWARE["h200"]).tokens > 1.9 * cap.tokens


def test_no_memory_no_capacity_and_weights_that_do_not_fit():
    with pytest.raises(PacerError, match="memory_gib"):
        kv_capacity(TINY, FLAT)
    with pytest.raises(PacerError, match="no room"):
        kv_capacity(MODELS["llama-2-13b"], replace(HARDWARE["h100"], memory_gib=24.0))
