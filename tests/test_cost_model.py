"""The roofline cost model against the hand-worked figures of docs/design.md#reference-figures
(Llama-2-7B on one H100, fp16: 500 TFLOP/s, 3.35 TB/s), each within 25 %, and `pacer cost`."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest

from shared.cost_model import (MODELS, ChunkShape, ModelShape, Precision, estimate_iteration,
                               load_model_shape, model_shape_of)
from services import cost_cmd
from shared.errors import PacerError
from shared.hardware import HARDWARE, load_hardware

LLAMA = MODELS["llama-2-7b"]
H100 = HARDWARE["h100"]
TOLERANCE = 0.25
K, GB, TB = 1024, 1e9, 1e12


def assert_close(ours: float, reference: float, what: str) -> None:
    error = ours / reference - 1
    assert abs(error) <= TOLERANCE, f"{what}: ours {ours:.4g}, reference {reference:.4g} ({error:+.1%})"


def decodes(batch: int, context: int) -> list[tuple[int, int]]:
    return [(1, context)] * batch


def prefill(n: int, prefix: int = 0) -> tuple[int, int]:
    return (n, prefix + n)


def max_prefill_tokens_within(budget_ms: float, decode_chunks: list[ChunkShape], prefix_len: int,
                              model: ModelShape, hw, dtype_bytes: float | Precision = 2,
                              limit: int = 1 << 24) -> int:
    """The oracle `RooflineCost.max_prefill_rows` is held to: the largest prefill chunk N over
    a cached prefix of `prefix_len` such that `decode_chunks + [(N, prefix_len + N)]` takes at
    most `budget_ms` by `estimate_iteration`, 0 if none fits. Time never falls as N grows,
    so a doubling search then a bisection finds it."""
    def fits(n: int) -> bool:
        chunks = decode_chunks + [(n, prefix_len + n)]
        return estimate_iteration(chunks, model, hw, dtype_bytes).time_ms <= budget_ms

    if not fits(1):
        return 0
    lo = 1                                  # fits
    while lo < limit and fits(min(2 * lo, limit)):
        lo = min(2 * lo, limit)
    if lo == limit:
        return limit
    hi = min(2 * lo, limit)                 # does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# docs/design.md#reference-figures: 8 decodes at context ~1k, alone and with a prefill:
#   Iteration mix       Linear   Attn    Total   Wall time
#   8 decodes           ~110 GF  ~4 GF   ~115 GF ~6 ms
#   + 1 k prefill       ~14 TF   ~0.3 TF ~14 TF  ~30 ms
#   + 4 k prefill       ~57 TF   ~4 TF   ~61 TF  ~120 ms
#   + 16 k prefill      ~225 TF  ~67 TF  ~290 TF ~580 ms
#   + 100 k prefill     ~1.4 PF  ~2.6 PF ~4 PF   ~8 s
# Prefills alone:
#   100 tokens          ~1.4 TF  ~2.6 GF          ~4 ms
#   10 k tokens         ~140 TF  ~26 TF           ~320 ms
#   100 + 10 k together ~141 TF  ~26 TF           ~330 ms
# The 100-token row by the same rules (14 GFLOPs per row, 0.52 MFLOPs per pair):
# 100 · 14 GF = 1.4 TF and 100²/2 · 0.52 MF = 2.6 GF (the test's 3 GF is that, rounded up);
# its 4 ms is the weight-read time.
REFERENCE_ITERATIONS = [
    ("8 decode x 1k", decodes(8, K), 110e9, 4e9, 115e9, 6),
    ("8 decode + 1k prefill", decodes(8, K) + [prefill(K)], 14e12, 0.3e12, 14e12, 30),
    ("8 decode + 4k prefill", decodes(8, K) + [prefill(4 * K)], 57e12, 4e12, 61e12, 120),
    ("8 decode + 16k prefill", decodes(8, K) + [prefill(16 * K)], 225e12, 67e12, 290e12, 580),
    ("8 decode + 100k prefill", decodes(8, K) + [prefill(100_000)], 1.4e15, 2.6e15, 4e15, 8000),
    ("100-token prefill alone", [prefill(100)], 1.4e12, 3e9, None, 4),
    ("10k prefill alone", [prefill(10_000)], 140e12, 26e12, None, 320),
    ("100 + 10k prefill together", [prefill(100), prefill(10_000)], 141e12, 26e12, None, 330),
]


@pytest.mark.parametrize("name,chunks,linear,attn,total,wall_ms", REFERENCE_ITERATIONS,
                         ids=[row[0] for row in REFERENCE_ITERATIONS])
def test_reference_iteration_mix(name, chunks, linear, attn, total, wall_ms):
    cost = estimate_iteration(chunks, LLAMA, H100)
    assert_close(cost.linear_flops, linear, f"{name} linear FLOPs")
    assert_close(cost.attention_flops, attn, f"{name} attention FLOPs")
    if total is not None:
        assert_close(cost.flops, total, f"{name} total FLOPs")
    assert_close(cost.time_ms, wall_ms, f"{name} wall ms")


def test_pure_decode_is_weight_bandwidth_bound():
    # ~6 ms, bound by reading the weights; a 1k prefill flips the iteration to compute.
    pure = estimate_iteration(decodes(8, K), LLAMA, H100)
    assert pure.bound == "memory" and pure.weight_bytes > pure.kv_bytes
    assert estimate_iteration(decodes(8, K) + [prefill(K)], LLAMA, H100).bound == "compute"


def test_reference_spreads():
    # Iterations differ by ~1300×; the short prefill's TTFT goes from ~4 ms alone to ~330 ms
    # beside a 10k one, ~80× (docs/design.md#reference-figures).
    pure = estimate_iteration(decodes(8, K), LLAMA, H100).time_ms
    worst = estimate_iteration(decodes(8, K) + [prefill(100_000)], LLAMA, H100).time_ms
    assert_close(worst / pure, 1300, "100k-prefill iteration / pure decode")
    alone = estimate_iteration([prefill(100)], LLAMA, H100).time_ms
    shared = estimate_iteration([prefill(100), prefill(10_000)], LLAMA, H100).time_ms
    assert_close(shared / alone, 80, "TTFT of the 100-token prompt, shared / alone")


# docs/design.md#reference-figures: decode at B = 32 (weight bytes 14 GB in every row):
#   L     KV bytes  total    I = 2Π·B / total
#   1 k   16 GB     30 GB    ~15
#   4 k   64 GB     78 GB    ~5.7
#   16 k  256 GB    270 GB   ~1.7
#   64 k  1.0 TB    1.0 TB   ~0.4
# The reference intensity counts the linears' FLOPs only (2Π · B = 448 GFLOPs at every L), so
# it is our linear_flops / bytes; our `intensity` also counts attention FLOPs.
REFERENCE_DECODES = [(K, 16 * GB, 30 * GB, 15), (4 * K, 64 * GB, 78 * GB, 5.7),
                     (16 * K, 256 * GB, 270 * GB, 1.7), (64 * K, 1.0 * TB, 1.0 * TB, 0.4)]


@pytest.mark.parametrize("context,kv_bytes,total_bytes,intensity", REFERENCE_DECODES,
                         ids=[f"B=32 L={row[0] // K}k" for row in REFERENCE_DECODES])
def test_reference_decode_rows(context, kv_bytes, total_bytes, intensity):
    cost = estimate_iteration(decodes(32, context), LLAMA, H100)
    assert_close(cost.weight_bytes, 14 * GB, "weight bytes")
    assert_close(cost.kv_bytes, kv_bytes, "KV bytes")
    assert_close(cost.bytes, total_bytes, "total bytes")
    assert_close(cost.linear_flops / cost.bytes, intensity, "intensity 2Π·B / total")
    assert cost.bound == "memory" and cost.intensity < H100.ridge()


# docs/design.md#reference-figures: a prefill chunk of C = 2048 over a cached prefix S
# (weight bytes 14 GB, KV (S + 2C) · 0.5 MiB; linear 2Π·C ≈ 27 TF, attention ≈ C·S · 0.52 MF):
#   S     total    linear / total  all FLOPs / total  regime
#   4 k   18 GB    ~1,500          ~1,800             compute-bound
#   64 k  50 GB    ~530            ~2,000             compute-bound
#   256 k 153 GB   ~170            ~2,000             compute-bound
#   1 M   565 GB   ~47             ~2,000             compute-bound
# Each cached token's 0.5 MiB meets all C rows, 0.52 MF each: ~C FLOPs a byte, whatever S.
REFERENCE_PREFILLS = [(4 * K, 18 * GB, 1500, 1800), (64 * K, 50 * GB, 530, 2000),
                      (256 * K, 153 * GB, 170, 2000), (1024 * K, 565 * GB, 47, 2000)]


@pytest.mark.parametrize("prefix,total_bytes,linear,intensity", REFERENCE_PREFILLS,
                         ids=[f"C=2048 S={row[0] // K}k" for row in REFERENCE_PREFILLS])
def test_reference_prefill_rows(prefix, total_bytes, linear, intensity):
    cost = estimate_iteration([prefill(2048, prefix)], LLAMA, H100)
    assert_close(cost.bytes, total_bytes, "total bytes")
    assert_close(cost.linear_flops / cost.bytes, linear, "intensity 2Π·C / total")
    assert_close(cost.intensity, intensity, "intensity, attention included")
    assert cost.bound == "compute" and cost.intensity > H100.ridge()


def test_reference_ridge_and_crossover():
    # The ridge R ≈ 150 FLOPs/byte; weights = KV at L·B ≈ 27 k, so at B = 32, L ≈ 850.
    assert_close(H100.ridge(), 150, "H100 ridge")
    cost = estimate_iteration(decodes(32, 850), LLAMA, H100)
    assert_close(cost.kv_bytes, cost.weight_bytes, "KV bytes at the crossover")


def test_chunking_moves_attention_but_rereads_the_cache():
    # Chunks' causal pairs sum to the unchunked N²/2; the cache reads grow ~N²/(2C), about 25×
    # for N = 100 k, C = 2048 (docs/design.md#why-chunked-prefill).
    n, c = 100_000, 2048
    whole = estimate_iteration([prefill(n)], LLAMA, H100)
    parts = [estimate_iteration([prefill(min(c, n - s), s)], LLAMA, H100) for s in range(0, n, c)]
    assert math.isclose(sum(p.attention_flops for p in parts), whole.attention_flops, rel_tol=1e-9)
    writes = n * LLAMA.kv_bytes_per_token(2)
    reads_ratio = (sum(p.kv_bytes for p in parts) - writes) / (whole.kv_bytes - writes)
    assert_close(reads_ratio, 25, "cache reads, chunked / unchunked")


def test_cost_model_imports_stdlib_only():
    # The scheduler core calls it every iteration; it must not drag in torch or numpy.
    code = ("import sys, shared.cost_model, shared.hardware; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_builtin_shapes_match_published_parameter_counts():
    assert LLAMA.num_params == 6_738_415_616
    assert MODELS["llama-2-13b"].num_params == 13_015_864_320
    assert MODELS["llama-3-8b"].num_params == 8_030_261_248
    assert MODELS["smollm2-135m"].num_params == 134_515_008


def test_gqa_shrinks_the_kv_bytes_per_token():
    # Llama-3-8B: 8 KV heads for 32 query heads, so K_tok is a quarter of Llama-2-7B's 512 KiB.
    assert LLAMA.kv_bytes_per_token(2) == 512 * 1024
    assert MODELS["llama-3-8b"].kv_bytes_per_token(2) == 128 * 1024
    a, b = (estimate_iteration(decodes(32, 4 * K), MODELS[m], H100) for m in ("llama-2-7b", "llama-3-8b"))
    assert b.kv_bytes < a.kv_bytes / 3.9 and b.attention_flops == a.attention_flops


def test_hf_config_json_gives_the_builtin_shape(tmp_path):
    # The fields of SmolLM2-135M-Instruct's config.json that the shape reads.
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
              "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
              "vocab_size": 49152, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for spec in (str(folder), str(folder / "config.json")):
        shape = load_model_shape(spec)
        assert shape == ModelShape(**{**MODELS["smollm2-135m"].__dict__, "name": shape.name})
        assert shape.name == "SmolLM2-135M-Instruct"


SMOL_CONFIG = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
               "num_hidden_layers": 30, "num_key_value_heads": 3, "vocab_size": 49152}


@pytest.mark.parametrize("field,value", [
    ("num_attention_heads", 0), ("num_hidden_layers", 2.0), ("num_hidden_layers", -2),
    ("hidden_size", "576"), ("intermediate_size", 1.5), ("num_key_value_heads", True),
    ("head_dim", 0)])
def test_a_malformed_config_json_is_an_error_naming_the_field(field, value, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMOL_CONFIG, field: value}))
    with pytest.raises(PacerError, match=f"{field} must be a positive integer, got {value!r}"):
        load_model_shape(str(path))
    assert _cost_cli(["--model", str(path), "--decode", "8x1024"]) == 2
    assert f"{field} must be a positive integer" in capsys.readouterr().err


def test_a_config_json_lacking_a_field_or_null_where_optional(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in SMOL_CONFIG.items() if k != "vocab_size"}))
    with pytest.raises(PacerError, match="has no 'vocab_size'"):
        load_model_shape(str(path))
    path.write_text(json.dumps({**SMOL_CONFIG, "num_key_value_heads": None, "head_dim": None}))
    shape = load_model_shape(str(path))
    assert (shape.num_kv_heads, shape.head_dim, shape.hidden_size) == (9, 64, 576)


@pytest.mark.parametrize("config,error", [
    # the cost model once read these its own way: a string "false" as True, a nested
    # text_config the workers refuse as if it were served
    ({**SMOL_CONFIG, "tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"model_type": "llava", "text_config": SMOL_CONFIG}, "is not supported"),
])
def test_a_config_json_is_read_as_the_workers_read_it(config, error, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(PacerError, match=error):
        load_model_shape(str(path))


def test_a_gguf_model_gives_its_shape(capsys):
    from shared.model_source import default_model_path

    path = default_model_path()
    shape = load_model_shape(path)
    assert shape == ModelShape(**{**MODELS["smollm2-135m"].__dict__, "name": shape.name})
    assert _cost_cli(["--model", path, "--decode", "8x1024"]) == 0
    assert "wall time" in capsys.readouterr().out


def test_shape_of_a_served_model_config():
    from shared.model_config import ModelConfig

    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                         head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    assert model_shape_of(config, "smollm2-135m") == MODELS["smollm2-135m"]


def test_unknown_model_and_hardware_are_user_errors(tmp_path):
    with pytest.raises(PacerError, match="unknown model"):
        load_model_shape("llama-9-1t")
    with pytest.raises(PacerError, match="unknown hardware"):
        load_hardware("tpu-v9")
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps({"name": "x", "tflops": {"bfloat16": -1}, "bandwidth_tbps": 1}))
    with pytest.raises(PacerError, match="positive"):
        load_hardware(str(bad))
    with pytest.raises(PacerError, match="q_rows"):
        estimate_iteration([(5, 4)], LLAMA, H100)


def test_hardware_overrides_move_the_roofline():
    slow = H100.with_overrides(tflops=250.0, bandwidth_tbps=1.675)
    fast = estimate_iteration(decodes(8, K) + [prefill(4 * K)], LLAMA, H100)
    halved = estimate_iteration(decodes(8, K) + [prefill(4 * K)], LLAMA, slow)
    assert math.isclose(halved.compute_ms, 2 * fast.compute_ms)
    assert math.isclose(halved.memory_ms, 2 * fast.memory_ms)
    assert math.isclose(slow.ridge(), H100.ridge() * 250 / 500 * 3.35 / 1.675)


@pytest.mark.parametrize("budget_ms,prefix", [(50, 0), (50, 60_000), (200, 8192), (6, 0)])
def test_max_prefill_tokens_within_is_the_largest_chunk_that_fits(budget_ms, prefix):
    running = decodes(8, K)
    n = max_prefill_tokens_within(budget_ms, running, prefix, LLAMA, H100)
    assert n >= 1

    def time_ms(rows: int) -> float:
        return estimate_iteration(running + [prefill(rows, prefix)], LLAMA, H100).time_ms

    assert time_ms(n) <= budget_ms < time_ms(n + 1)


def test_max_prefill_tokens_within_is_zero_when_the_decodes_fill_the_budget():
    running = decodes(8, K)
    assert estimate_iteration(running, LLAMA, H100).time_ms > 5
    assert max_prefill_tokens_within(5, running, 0, LLAMA, H100) == 0
    assert max_prefill_tokens_within(50, [], 0, LLAMA, H100) > 0


def _cost_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pacer")
    cost_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cost", *argv])
    return args.run(args)


def test_cost_cli_json(capsys):
    rc = _cost_cli(["--model", "llama-2-7b", "--hw", "h100", "--decode", "8x1024",
                    "--prefill", "4096", "--prefill", "1024@2048", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    expected = estimate_iteration(decodes(8, K) + [(4096, 4096), (1024, 3072)], LLAMA, H100)
    for field in ("time_ms", "flops", "bytes", "intensity", "compute_ms", "memory_ms"):
        assert math.isclose(out[field], getattr(expected, field)), field
    assert out["bound"] == "compute" and out["num_tokens"] == 8 + 4096 + 1024


def test_cost_cli_table_and_overrides(capsys):
    assert _cost_cli(["--model", "smollm2-135m", "--decode", "32x2048", "--hw-tflops", "1",
                      "--hw-bandwidth-tbps", "0.05", "--dtype-bytes", "2"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "wall time" in out and "memory-bound" in out


@pytest.mark.parametrize("argv,flag", [(["--decode", "8y1024"], "--decode"),
                                       (["--decode", "0x1024"], "--decode"),
                                       (["--prefill", "1024@"], "--prefill"),
                                       (["--hw", "tpu-v9", "--decode", "1x1"], "hardware"),
                                       # 1e-320 priced the iteration at inf ms; inf was
                                       # refused naming the profile's field
                                       (["--decode", "1x1", "--hw-bandwidth-tbps", "1e-320"],
                                        "--hw-bandwidth-tbps must be from 1e-06 to 1e+06"),
                                       (["--decode", "1x1", "--hw-tflops", "inf"],
                                        "--hw-tflops must be from"),
                                       (["--decode", "1x1", "--hw-tflops", "0"], "--hw-tflops"),
                                       ([], "nothing to run")])
def test_cost_cli_bad_input_is_one_error_line(capsys, argv, flag):
    assert _cost_cli(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pacer cost: error:") and flag in lines[0]
    assert captured.out == ""


HUGE = "1" + "0" * 400


@pytest.mark.parametrize("argv,flag", [(["--decode", f"1x{HUGE}"], "--decode"),
                                       (["--decode", f"{HUGE}x1"], "--decode"),
                                       (["--prefill", HUGE], "--prefill"),
                                       (["--prefill", f"1@{HUGE}"], "--prefill"),
                                       (["--decode", f"{2**40 + 1}x1"], "--decode"),
                                       (["--transfer", HUGE, "--fabric", "ib-hdr"], "--transfer")])
def test_cost_cli_counts_past_2_40_are_one_error_line(capsys, argv, flag):
    # Unbounded, they overflowed the float sums with a traceback.
    assert _cost_cli(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pacer cost: error: {flag}: counts must be "
                                                   "at most 2**40")


def test_cost_cli_takes_counts_up_to_2_40(capsys):
    assert _cost_cli(["--prefill", f"1@{2**40 - 1}", "--json"]) == 0
    assert math.isfinite(json.loads(capsys.readouterr().out)["time_ms"])


def test_a_group_of_chunks_costs_the_same_as_its_copies():
    from shared.cost_model import estimate_groups

    groups = [(8, (1, 1024)), (1, (512, 2048)), (3, (1, 77))]
    copies = [chunk for count, chunk in groups for _ in range(count)]
    grouped, listed = estimate_groups(groups, LLAMA, H100), estimate_iteration(copies, LLAMA, H100)
    for field, value in listed.__dict__.items():
        assert getattr(grouped, field) == pytest.approx(value), field


def test_cost_cli_a_billion_decodes_is_priced_without_listing_them():
    # `--decode BxL` once built a list of B chunks: ~8 GB and ~20 min at B = 1e9. Under a
    # 2 GiB address space such a list fails at once, so the estimate must come without one.
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "cost", "--decode",
                           "1000000000x1024", "--json"], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    one = estimate_iteration([(1, 1024)], LLAMA, H100)
    assert out["num_tokens"] == 10**9
    assert out["kv_bytes"] == pytest.approx(10**9 * one.kv_bytes)


def test_cost_cli_says_why_there_is_no_kv_capacity(capsys):
    # 13B weights at 8 bytes (104 GB) fill an 80 GiB H100: the line once vanished unexplained.
    assert _cost_cli(["--model", "llama-2-13b", "--dtype-bytes", "8", "--decode", "1x10"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("KV capacity")]
    assert len(lines) == 1 and "none: " in lines[0] and "leaves no room for a KV cache" in lines[0]
    assert _cost_cli(["--model", "llama-2-13b", "--dtype-bytes", "8", "--decode", "1x10",
                      "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_capacity"] is None and "leaves no room" in out["kv_capacity_error"]
    # what to change is said in `pacer cost`'s own flags, not in the serving ones it lacks
    for said in (lines[0], out["kv_capacity_error"]):
        assert not any(flag in said for flag in ("--gpu-memory-utilization", "--kv-cache-memory",
                                                 "--num-kv-blocks", "--max-num-batched-tokens"))
        assert said.endswith(cost_cmd.COST_REMEDY) and "--hw" in said and "--tp" in said
