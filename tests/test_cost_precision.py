"""The roofline under tensor parallelism and with weights, KV cache and activations of their own
element sizes (docs/design.md#the-roofline-cost-model), worked by hand for Llama-2-7B on H100:

    one layer's matmuls  4096·4096·4 + 3·4096·11008     = 202,375,168 params
    weights read         32 layers of them + norms + LM head = 6,607,343,616 params
    K_tok                2 · 32 layers · 32 heads · 128 · 2 B = 524,288 B
"""
from __future__ import annotations

import json

import pytest

from services.cli import main
from shared.cost_model import MODELS, Precision, RooflineCost, estimate_iteration, kv_capacity
from shared.engine_args import EngineArgs
from shared.errors import PacerError
from shared.hardware import HARDWARE, hardware_from_dict
from tests.test_cost_model import _cost_cli, max_prefill_tokens_within

LLAMA, H100 = MODELS["llama-2-7b"], HARDWARE["h100"]
WEIGHTS = 6_607_343_616            # params read per iteration
K_TOK = 524_288                    # bytes per token at 2 B
DECODES = [(1, 1024)] * 8          # each reads 1024 tokens and writes 1: 8,200 tokens


def test_the_hand_worked_figures_hold():
    assert LLAMA.params_read_per_iteration == WEIGHTS and LLAMA.kv_bytes_per_token(2) == K_TOK


def test_tp_2_prices_one_rank_and_its_all_reduces():
    cost = estimate_iteration(DECODES, LLAMA, H100, Precision(tp=2))
    # half of every weight but the 2 · 32 + 1 norms of 4096, which each rank holds whole
    assert cost.weight_bytes == (WEIGHTS + 65 * 4096) * 2 / 2
    assert cost.kv_bytes == 8_200 * K_TOK / 2
    assert cost.memory_ms == pytest.approx((WEIGHTS + 65 * 4096 + 8_200 * K_TOK / 2) / 3.35e9)
    # 2·32 + 1 all-reduces of 8 rows × 4096 × 2 B = 4,259,840 B; a ring of 2 sends 2·1/2 of it
    # at 450 GB/s
    assert cost.allreduce_ms == pytest.approx(4_259_840 / 450e6)                       # 9.5 µs
    # the LM head all-gathers each of the 8 chunks' float32 logits, 32,000 × 4 B; a ring of 2
    # sends 1/2 of them through each link: 512,000 B, 1.1 µs
    assert cost.allgather_ms == pytest.approx(8 * 32_000 * 4 / 2 / 450e6)
    assert cost.time_ms == pytest.approx(2.614_09 + 0.009_466 + 0.001_138, abs=1e-5)
    whole = estimate_iteration(DECODES, LLAMA, H100)
    assert cost.flops == pytest.approx(whole.flops / 2) and whole.allreduce_ms == 0
    # four ranks send 2·3/4 of each row's bytes
    assert estimate_iteration(DECODES, LLAMA, H100, Precision(tp=4)).allreduce_ms == \
        pytest.approx(4_259_840 * 1.5 / 450e6)

    # the vocabulary is padded to a multiple of tp: 32,000 over 3 ranks gathers 32,001
    assert estimate_iteration([(1, 10)], LLAMA, H100, Precision(tp=3)).allgather_ms == \
        pytest.approx(32_001 * 4 * 2 / 3 / 450e6)


def test_tp_cuts_prefill_chunks_twice_as_long_and_both_forms_agree():
    one = RooflineCost(LLAMA, H100)
    two = RooflineCost(LLAMA, H100, tp=2)
    for chunks in (DECODES, DECODES + [(2048, 6144)], [(8192, 8192)]):
        assert two.iteration_ms(chunks) == pytest.approx(
            estimate_iteration(chunks, LLAMA, H100, Precision(tp=2)).time_ms)
    # an 8k prefill: 65 all-reduces of 8192 rows × 8 KiB = 4.36 GB, 9.7 ms at 450 GB/s
    assert estimate_iteration([(8192, 8192)], LLAMA, H100, Precision(tp=2)).allreduce_ms == \
        pytest.approx(65 * 8192 * 8192 / 450e6)
    for budget, prefix in ((20.0, 0), (20.0, 50_000), (60.0, 4096)):
        rows = two.max_prefill_rows(budget, DECODES, prefix)
        assert rows == max_prefill_tokens_within(budget, DECODES, prefix, LLAMA, H100,
                                                 Precision(tp=2))
        assert two.iteration_ms(DECODES + [(rows, prefix + rows)]) <= budget
        assert two.iteration_ms(DECODES + [(rows + 1, prefix + rows + 1)]) > budget
        # half the work a row: about twice the rows (less for the all-reduces, more where the
        # fixed reads of weights and cached K/V took most of one GPU's budget)
        assert rows / one.max_prefill_rows(budget, DECODES, prefix) > 1.7


def test_tp_needs_an_interconnect_and_heads_it_divides(capsys):
    bare = hardware_from_dict({"tflops": 10, "bandwidth_tbps": 0.1})
    with pytest.raises(PacerError, match="interconnect_gb_per_s"):
        RooflineCost(LLAMA, bare, tp=2)
    assert RooflineCost(LLAMA, bare).iteration_ms(DECODES) > 0
    assert _cost_cli(["--decode", "8x1024", "--tp", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_4_bit_weights_beside_a_16_bit_cache():
    cost = estimate_iteration(DECODES, LLAMA, H100, Precision(2, weight_bytes=0.5))
    assert cost.weight_bytes == WEIGHTS * 0.5 and cost.kv_bytes == 8_200 * K_TOK
    # the pool: 4-bit weights leave more room, but each token still takes 512 KiB
    cap = kv_capacity(LLAMA, H100, Precision(2, weight_bytes=0.5))
    assert cap.kv_bytes_per_token == K_TOK
    assert cap.weight_bytes == (32 * 202_375_168 + 2 * 32_000 * 4096 + 65 * 4096) * 0.5
    # ...the 1.5 B a weight saved, 10.1 GB, hold 19,280 more tokens
    assert cap.tokens - kv_capacity(LLAMA, H100).tokens == pytest.approx(
        3 * 3_369_207_808 / K_TOK, abs=2)
    assert kv_capacity(LLAMA, H100, 0.5).tokens > 3.9 * cap.tokens    # what --dtype-bytes 0.5 gave


def test_cost_cli_prices_weights_and_cache_apart(capsys):
    assert _cost_cli(["--decode", "8x1024", "--weight-bytes", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_bytes"] == 3_303_671_808 and out["kv_bytes"] == 4_299_161_600
    assert out["kv_capacity"]["kv_bytes_per_token"] == K_TOK
    assert _cost_cli(["--decode", "8x1024", "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert "one rank of tp 2" in text and "all-reduce time" in text


# 1e308 and 1e300 made the weights' bytes infinite: an OverflowError traceback, or an
# infinite wall time printed as the answer
@pytest.mark.parametrize("flag,value", [("--dtype-bytes", "inf"), ("--dtype-bytes", "1e-9"),
                                        ("--weight-bytes", "nan"), ("--kv-bytes", "0.01"),
                                        ("--dtype-bytes", "1e308"), ("--weight-bytes", "1e300"),
                                        ("--kv-bytes", "9")])
def test_element_sizes_must_be_from_a_bit_to_a_float64(flag, value, capsys):
    assert _cost_cli(["--decode", "8x1024", flag, value]) == 2
    assert _cost_cli(["--transfer", "4096", flag, value]) == 2
    assert main(["simulate", "--num-requests", "3", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count(f"{flag} must be a number of bytes from 0.125 (one bit) to 8 (float64)") \
        == 3, err


def test_the_served_budget_prices_the_quantization_and_tp_in_use():
    from shared.engine_layout import engine_layout

    def cost(**kw):
        layout = engine_layout(EngineArgs(max_iteration_ms=30.0, hw="h100", dtype="bfloat16",
                                          device="cpu", **kw))
        return layout.scheduler_config.iteration_cost

    int4, int8 = cost(quantization="int4"), cost(quantization="int8", tp=3)
    assert (int4.weight_bytes, int4.kv_bytes, int4.tp) == (0.5, 2, 1)
    assert (int8.weight_bytes, int8.kv_bytes, int8.tp) == (1.0, 2, 3)
    plain = cost(quantization="none")
    assert (plain.weight_bytes, plain.kv_bytes) == (2, 2)
    assert int4.iteration_ms([(1, 64)]) < plain.iteration_ms([(1, 64)])


def test_simulate_sizes_one_rank_s_pool_and_prices_its_forward(capsys):
    # --kv-cache-memory is per rank, as served: 60 GiB of 8 MiB blocks (16 tokens of 512 KiB),
    # of 4 MiB at tp 2 (16 of the 32 KV heads), of 2 MiB with a 1-byte cache beside
    def run(*flags):
        assert main(["simulate", "--num-requests", "5", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    assert run()["config"]["num_kv_blocks"] == 7_680
    tp2 = run("--tp", "2")
    assert tp2["config"]["num_kv_blocks"] == 15_360 and tp2["precision"]["tp"] == 2
    assert run("--tp", "2", "--kv-bytes", "1")["config"]["num_kv_blocks"] == 30_720
    # one rank's forward: each iteration well under one GPU's
    one, two = (run(*flags)["modes"]["chunked"]["iteration_ms"]["median"]
                for flags in ((), ("--tp", "2")))
    assert two < 0.6 * one


def test_replay_refuses_what_it_would_ignore(capsys):
    assert main(["simulate", "--replay", "docs/interference_defaults.json", "--tp", "2"]) == 2
    assert "leave out --tp, --weight-bytes and --kv-bytes" in capsys.readouterr().err


def test_the_served_system_and_the_cost_model_count_one_rank_s_weights_alike():
    # The vocab-parallel embedding and LM head are split tp ways (their vocabulary padded to a
    # multiple of tp); the norms are whole. The pool sizing once counted both tables whole.
    from shared import gpu_memory

    smol = MODELS["smollm2-135m"]                      # tied: what a rank holds it reads
    for tp in (1, 3):
        assert gpu_memory.weight_bytes(smol, 2, tp) == Precision(2, tp=tp).weights(smol)
    # untied, under tp 2: half of each of the two tables (32,000 · 4096 each)
    assert gpu_memory.weight_bytes(LLAMA, 2, 2) - gpu_memory.weight_bytes(LLAMA, 2, 1) / 2 \
        == pytest.approx(65 * 4096 * 2 / 2)


def test_a_kv_block_is_block_size_tokens_of_one_rank_s_k_tok():
    assert Precision(2, tp=2).kv_block_bytes(LLAMA, 16) == 16 * K_TOK / 2
    assert Precision(2, kv_bytes=1).kv_block_bytes(LLAMA, 16) == 16 * K_TOK / 2
