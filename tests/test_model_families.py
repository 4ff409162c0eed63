"""Checkpoints beyond plain Llama, each against transformers (float32, greedy, token for token,
with chunks and preemption): Llama 3.1/3.2's `llama3` RoPE scaling, `linear` scaling, Qwen2
(biases on Q, K and V), Mistral (with and without a sliding window longer than what is served),
and a GGUF whose llama3 scaling llama.cpp's converter wrote as a tensor."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from gpu_worker.model.layers import rope_inv_freq
from shared.engine_args import EngineArgs
from shared.engine_layout import engine_layout
from shared.errors import ModelLoadError, PacerError
from shared.model_config import RopeScaling, load_model_config, quantization_scheme
from shared.model_source import resolve_model
from tests.helpers_tiny_model import write_tiny_gguf, write_tiny_llama
from tests.hf_reference import assert_same_tokens, hf_greedy
from tests.test_engine_parity import CONFIGS, check_parity, random_prompts, run_engine

# head_dim 16, theta 1e4: wavelengths 6.3, 20, 63, 199, 628, ... positions. Against an
# original context of 64 (high 16, low 64) the first is kept, the next two blended and the
# rest divided by the factor: all three of llama3's cases
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
FAMILIES = {
    "llama3-rope": dict(rope_scaling=LLAMA3),
    "linear-rope": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mistral": dict(family="mistral", sliding_window=None),
    "mistral-window": dict(family="mistral", sliding_window=256),
    "qwen2": dict(family="qwen2", rope_theta=1e6),
    "qwen2-tied": dict(family="qwen2", tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = write_tiny_llama(tmp_path_factory.mktemp(request.param), seed=5,
                            **FAMILIES[request.param])
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    # long enough to run far past the llama3 scaling's original context of 64 positions
    prompts = random_prompts(hf.config.vocab_size, 2, [7, 60, 130, 200])
    refs = [hf_greedy(hf, p, hf.config.eos_token_id) for p in prompts]
    return request.param, path, prompts, refs


@pytest.mark.parametrize("name,overrides,expect_preemption", CONFIGS)
def test_matches_transformers(family, name, overrides, expect_preemption):
    which, path, prompts, refs = family
    check_parity(path, prompts, refs, f"{which} {name}", {**overrides, "max_model_len": 256},
                 expect_preemption)


def test_inverse_frequencies_are_transformers_bits(tmp_path):
    """The scaled frequencies equal transformers' own, bit for bit, for a real Llama 3.1's
    parameters (head_dim 128, theta 5e5, factor 8, original context 8192)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                      rope_scaling=params, max_position_embeddings=131072)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    assert torch.equal(ours, theirs)
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=10000.0,
                      rope_scaling={"rope_type": "linear", "factor": 4.0})
    theirs, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    assert torch.equal(rope_inv_freq(128, 10000.0, RopeScaling("linear", 4.0)), theirs)


def _config(path: str, **changes) -> str:
    file = os.path.join(path, "config.json")
    with open(file, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def test_what_the_configs_say(tmp_path):
    path = write_tiny_llama(tmp_path / "l3", rope_scaling=LLAMA3)
    cfg = load_model_config(resolve_model(path))
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    # transformers 4's spelling of the same (Llama 3.1's own config.json)
    _config(path, rope_parameters=None, rope_theta=10000.0,
            rope_scaling={**LLAMA3, "original_max_position_embeddings": 8192})
    assert load_model_config(resolve_model(path)).rope_scaling.original_max_position_embeddings \
        == 8192
    window = write_tiny_llama(tmp_path / "mw", family="mistral", sliding_window=256)
    cfg = load_model_config(resolve_model(window))
    assert (cfg.architecture, cfg.max_position_embeddings, cfg.sliding_window) == \
        ("mistral", 256, 256)
    with pytest.raises(PacerError, match=r"\[2, 256\] \(the model's sliding window"):
        engine_layout(EngineArgs(model=window, max_model_len=512))
    none = write_tiny_llama(tmp_path / "m", family="mistral", sliding_window=None)
    cfg = load_model_config(resolve_model(none))
    assert (cfg.max_position_embeddings, cfg.sliding_window) == (1024, None)


# ---- the same as a GGUF: llama.cpp writes llama3's scaling as a tensor of divisors ---------

@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = write_tiny_llama(tmp_path_factory.mktemp("l3"), seed=5, **FAMILIES["llama3-rope"])
    gguf = write_tiny_gguf(tmp_path_factory.mktemp("l3g") / "l3.gguf", path, pre="llama-bpe")
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size, 2, [7, 60, 130, 200])
    return path, gguf, prompts, [hf_greedy(hf, p, hf.config.eos_token_id) for p in prompts]


def test_gguf_rope_freqs_read_as_llama3_scaling(llama3_gguf):
    path, gguf, prompts, refs = llama3_gguf
    assert load_model_config(resolve_model(gguf)).rope_scaling == \
        load_model_config(resolve_model(path)).rope_scaling
    check_parity(gguf, prompts, refs, "llama3 gguf", {**CONFIGS[1][1], "max_model_len": 256},
                 False)


def test_gguf_rope_freqs_of_another_kind_are_refused(llama3_gguf, tmp_path):
    from gguf import GGUFReader
    _, gguf, _, _ = llama3_gguf
    (t,) = [t for t in GGUFReader(gguf).tensors if t.name == "rope_freqs.weight"]
    odd = tmp_path / "odd.gguf"
    data = bytearray(open(gguf, "rb").read())
    start = int(t.data_offset)
    divisors = np.frombuffer(bytes(data[start:start + 4 * t.n_elements]), dtype=np.float32)
    data[start:start + 4 * t.n_elements] = (divisors * 1.1).astype(np.float32).tobytes()
    odd.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="rope_freqs.weight is no llama3 scaling"):
        load_model_config(resolve_model(str(odd)))


# ---- Qwen2's biases through tensor parallelism and the integer and bfloat16 paths ----------

@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = write_tiny_llama(tmp_path_factory.mktemp("q2"), seed=5, **FAMILIES["qwen2"])
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size, 3, [9, 70, 150])
    return path, prompts, [hf_greedy(hf, p, hf.config.eos_token_id) for p in prompts]


def test_qwen2_tp2_splits_the_biases_with_their_heads(qwen2):
    """Each rank holds its heads' share of each of the three biases (a bias cut in one piece
    would add Q's entries to K's heads)."""
    from tests.test_tensor_parallel import greedy, run_tp
    path, prompts, refs = qwen2
    ours, _ = run_tp(path, prompts, greedy(len(prompts)), 2, max_num_batched_tokens=16,
                     max_model_len=256)
    for k, (o, (r, logits)) in enumerate(zip(ours, refs)):
        assert_same_tokens(o, r, logits, f"qwen2 tp=2 prompt {k}")


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "none"), ("float32", "int8"),
                                                ("bfloat16", "int4")])
def test_qwen2_narrower_paths_follow_float32(qwen2, dtype, quantization):
    """bfloat16 weights and integer ones add the bias to the product: the first greedy tokens
    stay transformers' float32 ones (the model is tiny and random, so only the first few are
    asked of the narrower paths)."""
    path, prompts, refs = qwen2
    ours, _ = run_engine(path, prompts, {"max_num_batched_tokens": 16, "num_kv_blocks": 512,
                                         "max_model_len": 256, "dtype": dtype,
                                         "quantization": quantization})
    agree = [sum(a == b for a, b in zip(o[:8], r[:8])) for o, (r, _) in zip(ours, refs)]
    assert sum(agree) >= 0.75 * 8 * len(prompts), agree


def test_qwen2_gguf_matches_transformers(qwen2, tmp_path):
    """A Qwen2 GGUF as llama.cpp's converter writes one: `qwen2.*` metadata, Q and K rows in
    their own order (not Llama's pairs), the biases as `blk.N.attn_q.bias` and so on."""
    path, prompts, refs = qwen2
    gguf = write_tiny_gguf(tmp_path / "q2.gguf", path, arch="qwen2", pre="qwen2")
    assert load_model_config(resolve_model(gguf)) == load_model_config(resolve_model(path))
    check_parity(gguf, prompts, refs, "qwen2 gguf", {**CONFIGS[1][1], "max_model_len": 256},
                 False)


def test_qwen2_gguf_q8_0_follows_float32(qwen2, tmp_path):
    """The same GGUF with Q8_0 matrices, served as it ships (int8): the biases beside them."""
    from gguf import GGMLQuantizationType
    path, prompts, refs = qwen2
    gguf = write_tiny_gguf(tmp_path / "q8.gguf", path, GGMLQuantizationType.Q8_0, arch="qwen2",
                           pre="qwen2")
    ours, _ = run_engine(gguf, prompts, {"max_num_batched_tokens": 16, "num_kv_blocks": 512,
                                         "max_model_len": 256, "quantization": "auto"})
    agree = [sum(a == b for a, b in zip(o[:8], r[:8])) for o, (r, _) in zip(ours, refs)]
    assert sum(agree) >= 0.75 * 8 * len(prompts), agree


# ---- k-quants: a GGUF as most are downloaded (Q4_K_M: Q4_K, and Q6_K for some tensors) -----

@pytest.fixture(scope="module", params=["Q4_K_M", "Q4_K"])
def q4_k_m(request, tmp_path_factory):
    """A wide enough Llama (k-quant rows are 256 values) as a GGUF of random k-quant blocks,
    Q4_K_M-like (Q6_K for V and the MLP's down projection) or Q4_K alone, and transformers'
    own reading of that file."""
    from gguf import GGMLQuantizationType as Q

    from tests.hf_reference import gguf_py_read_faster
    from transformers import AutoModelForCausalLM
    hf_dir = write_tiny_llama(tmp_path_factory.mktemp("wide"), seed=1, hidden_size=256,
                              intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2)
    folder = tmp_path_factory.mktemp("q4km")
    six = {f"blk.{i}.{n}.weight": Q.Q6_K for i in range(2) for n in ("attn_v", "ffn_down")
           if request.param == "Q4_K_M"}
    gguf = write_tiny_gguf(folder / "m.gguf", hf_dir, Q.Q4_K, tensor_types=six)
    with gguf_py_read_faster():
        hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="m.gguf",
                                                  dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size, 4, [5, 40, 90])
    return gguf, prompts, [hf_greedy(hf, p, None) for p in prompts], \
        "int8" if six else "int4"


def test_k_quant_gguf_widened_matches_transformers(q4_k_m):
    gguf, prompts, refs, _ = q4_k_m
    check_parity(gguf, prompts, refs, "q4_k_m", {**CONFIGS[1][1], "max_model_len": 256}, False)


def test_k_quant_gguf_served_as_it_ships_follows_float32(q4_k_m):
    """`auto`: int8 where Q6_K tensors are (Q4_K's groups widened, Q6_K's quantized), int4
    from Q4_K alone (its groups as they are)."""
    gguf, prompts, refs, scheme = q4_k_m
    ours, _ = run_engine(gguf, prompts, {"max_num_batched_tokens": 16, "num_kv_blocks": 512,
                                         "max_model_len": 256, "quantization": "auto"})
    assert quantization_scheme("auto", resolve_model(gguf), "cpu") == scheme
    agree = [sum(a == b for a, b in zip(o[:8], r[:8])) for o, (r, _) in zip(ours, refs)]
    assert sum(agree) >= 0.75 * 8 * len(prompts), agree


def test_rope_tables_hold_the_served_context_not_the_configs(tmp_path):
    """A config that says a million positions, served with --max-model-len 64: the RoPE tables
    have 64 rows (a table per the config took 128 MB here, and for 1e9 positions 36 s before
    the allocator gave up), and generation runs to the end of the served context."""
    from shared.sampling import SamplingParams
    path = write_tiny_llama(tmp_path / "m", max_position_embeddings=10**6)
    params = SamplingParams(max_tokens=61, temperature=0.0, ignore_eos=True)
    (tokens,), engine = run_engine(path, [[5, 6, 7]], {"max_model_len": 64, "num_kv_blocks": 8},
                                   params)
    assert engine.runner.model.rotary.cos.shape[0] == 64
    assert len(tokens) == 61
