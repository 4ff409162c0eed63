"""iter_weights: HF names, float32 HF layout, from safetensors and from GGUF (every supported
type), equal to what transformers loads; refused files name the tensor and the reason."""
import dataclasses
import os
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from gpu_worker.weights import expected_shapes, iter_weights
from helpers_tiny_model import encode_gguf_tensor, write_tiny_gguf, write_tiny_llama
from shared.errors import ModelLoadError
from shared.model_config import READER, _PlainViewReader, load_model_config
from shared.model_source import resolve_model


def _load(path: str) -> tuple[dict[str, torch.Tensor], object]:
    source = resolve_model(path)
    config = load_model_config(source)
    weights = {}
    for name, tensor in iter_weights(source, config, progress=False):
        assert name not in weights, f"{name} yielded twice"
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        weights[name] = tensor
    assert {n: tuple(t.shape) for n, t in weights.items()} == expected_shapes(config)
    return weights, config


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"untied": write_tiny_llama(root / "untied"),
            "tied": write_tiny_llama(root / "tied", seed=1, tie_word_embeddings=True)}


# ---- the default model against transformers -----------------------------------------------

@pytest.mark.slow
def test_default_gguf_equals_transformers(default_hf):
    source = resolve_model(None)
    reference = default_hf.state_dict()
    ours, config = _load(source.path)
    assert config.tie_word_embeddings and "lm_head.weight" not in ours
    assert set(reference) == set(ours) | {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    assert torch.equal(ours["model.embed_tokens.weight"], reference["lm_head.weight"])


# ---- reading GGUF through a plain view -----------------------------------------------------

def _same_reading(path: str) -> None:
    from gguf import GGUFReader
    if READER is not _PlainViewReader:
        pytest.skip("this gguf-py's reader changed its _get: pacer reads through gguf-py's own")
    theirs, ours = GGUFReader(path), _PlainViewReader(path)
    assert list(theirs.fields) == list(ours.fields)
    for name, a in theirs.fields.items():
        b = ours.fields[name]
        assert (a.offset, a.types, a.data, len(a.parts)) == (b.offset, b.types, b.data,
                                                            len(b.parts)), name
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data.dtype, t.data.shape)
            for t in theirs.tensors] == [(t.name, t.tensor_type, t.shape.tolist(),
                                          t.data.dtype, t.data.shape) for t in ours.tensors]
    for a, b in zip(theirs.tensors, ours.tensors):
        assert a.data.tobytes() == b.data.tobytes(), a.name


def test_plain_view_reads_the_default_gguf_as_gguf_py_does():
    _same_reading(resolve_model(None).path)


def test_plain_view_reads_quantized_tiny_gguf_as_gguf_py_does(tiny_dirs, tmp_path):
    _same_reading(str(write_tiny_gguf(tmp_path / "m.gguf", tiny_dirs["untied"], Q.Q4_1)))


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_plain_view_reads_every_kind_of_value_as_gguf_py_does(tmp_path, endian):
    """Scalars, strings and arrays of each kind (the arrays of strings and numbers read in one
    loop, the others by gguf-py), in the machine's byte order and in the other."""
    import gguf
    path = str(tmp_path / f"{endian}.gguf")
    writer = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian[endian])
    writer.add_uint32("x.u32", 7)
    writer.add_float32("x.f32", 1.5)
    writer.add_string("x.str", "hello")
    writer.add_array("x.ints", [1, 2, 3])
    writer.add_array("x.strs", ["a", "bc", "", "é✓"])
    writer.add_array("x.floats", [0.5, -2.0])
    writer.add_array("x.bools", [True, False, True])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_reading(path)
    fields = _PlainViewReader(path).fields
    assert fields["x.strs"].contents() == ["a", "bc", "", "é✓"]
    assert fields["x.floats"].contents() == [0.5, -2.0]


# ---- tiny models --------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["untied", "tied"])
def test_safetensors_round_trip(tiny_dirs, which):
    saved = load_file(os.path.join(tiny_dirs[which], "model.safetensors"))
    ours, config = _load(tiny_dirs[which])
    assert config.tie_word_embeddings == (which == "tied")
    assert ours.keys() == (saved.keys() - {"lm_head.weight"} if which == "tied" else saved.keys())
    for name, tensor in ours.items():
        assert torch.equal(tensor, saved[name]), name


def test_bf16_safetensors_are_widened(tiny_dirs, tmp_path):
    src = tiny_dirs["untied"]
    _copy_without_weights(src, tmp_path)
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    save_file(bf16, str(tmp_path / "model.safetensors"))
    ours, _ = _load(str(tmp_path))
    for name, tensor in ours.items():
        assert torch.equal(tensor, bf16[name].float()), name


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_gguf_types_dequantize_to_hf_layout(tiny_dirs, tmp_path, qtype, which):
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tiny_dirs[which], qtype)
    saved = load_file(os.path.join(tiny_dirs[which], "model.safetensors"))
    ours, config = _load(gguf)
    assert config.tie_word_embeddings == (which == "tied")
    for name, tensor in ours.items():
        w = saved[name].numpy()
        # quantization blocks run along rows, and llama.cpp's Q/K permutation moves whole
        # rows, so unpermuting must give exactly the dequantized HF tensor
        expected = w if w.ndim == 1 else dequantize(encode_gguf_tensor(w, qtype), qtype).reshape(w.shape)
        np.testing.assert_array_equal(tensor.numpy(), expected, err_msg=name)
        assert np.abs(tensor.numpy() - w).max() < 0.05, name     # and close to the original


def test_unsupported_quant_type_names_the_tensor(tmp_path):
    hf = write_tiny_llama(tmp_path / "wide", hidden_size=256, intermediate_size=256,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    gguf = write_tiny_gguf(tmp_path / "k.gguf", hf, tensor_types={"blk.0.attn_q.weight": Q.IQ4_NL})
    source = resolve_model(gguf)
    with pytest.raises(ModelLoadError, match="tensor blk.0.attn_q.weight is IQ4_NL"):
        iter_weights(source, load_model_config(source))


def test_tensors_that_do_not_fit_the_config(tiny_dirs, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tiny_dirs["untied"])
    for path in (tiny_dirs["untied"], gguf):
        source = resolve_model(path)
        config = load_model_config(source)
        with pytest.raises(ModelLoadError, match=r"missing: \['model.layers.4."):
            iter_weights(source, dataclasses.replace(config, num_layers=5))
        with pytest.raises(ModelLoadError, match="mlp.down_proj.weight has shape"):
            iter_weights(source, dataclasses.replace(config, intermediate_size=96))


def test_progress_bar_on_stderr_at_a_terminal_only(tiny_dirs, capsys, monkeypatch):
    """A bar at a terminal; into a file or a pipe (a served worker's JSON log lines) none."""
    source = resolve_model(tiny_dirs["untied"])
    config = load_model_config(source)
    list(iter_weights(source, config, progress=True))          # captured: not a terminal
    assert capsys.readouterr() == ("", "")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    list(iter_weights(source, config, progress=True))
    out, err = capsys.readouterr()
    assert "loading weights" in err and out == ""
    list(iter_weights(source, config, progress=False))
    assert capsys.readouterr() == ("", "")


# ---- refused safetensors: shards, dtypes, damaged files ------------------------------------

def _copy_without_weights(src: str, dst) -> str:
    """The tiny model's config and tokenizer, linked, without its model.safetensors."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    return str(dst)


def _write_shards(src: str, dst) -> tuple[str, dict[str, torch.Tensor]]:
    """The tiny model in two shards with HF's index, as save_pretrained shards a large one."""
    import json
    path = _copy_without_weights(src, dst)
    saved = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(saved)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: saved[n] for n in part}, os.path.join(path, file), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: file for file, part in shards.items()
                                                  for n in part}}, f)
    return path, saved


def test_sharded_checkpoint_reads_the_files_its_index_names(tiny_dirs, tmp_path):
    """A file beside the shards that the index does not name (Mistral's consolidated
    weights, a stale download) is not read: it neither overrides a tensor nor is refused."""
    path, saved = _write_shards(tiny_dirs["untied"], tmp_path / "m")
    q = "model.layers.0.self_attn.q_proj.weight"
    save_file({q: torch.zeros_like(saved[q])}, os.path.join(path, "zzz-stale.safetensors"))
    save_file({"layers.0.attention.wq.weight": saved[q]},
              os.path.join(path, "consolidated.safetensors"))
    ours, _ = _load(path)
    for name, tensor in ours.items():
        assert torch.equal(tensor, saved[name]), name


def test_missing_shard_is_named(tiny_dirs, tmp_path):
    path, _ = _write_shards(tiny_dirs["untied"], tmp_path / "m")
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    source = resolve_model(path)
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        iter_weights(source, load_model_config(source))


def test_tensor_in_two_files_without_an_index_is_refused(tiny_dirs, tmp_path):
    path = _copy_without_weights(tiny_dirs["untied"], tmp_path / "m")
    saved = load_file(os.path.join(tiny_dirs["untied"], "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    save_file(saved, os.path.join(path, "model.safetensors"))
    save_file({q: torch.zeros_like(saved[q])}, os.path.join(path, "old.safetensors"))
    source = resolve_model(path)
    with pytest.raises(ModelLoadError, match=f"tensor {q} is in both model.safetensors and "
                                             "old.safetensors"):
        iter_weights(source, load_model_config(source))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.float8_e4m3fn])
def test_non_float_tensor_is_refused(tiny_dirs, tmp_path, dtype):
    path = _copy_without_weights(tiny_dirs["untied"], tmp_path / "m")
    saved = load_file(os.path.join(tiny_dirs["untied"], "model.safetensors"))
    up = "model.layers.0.mlp.up_proj.weight"
    saved[up] = (saved[up] * 100).to(dtype)
    save_file(saved, os.path.join(path, "model.safetensors"))
    source = resolve_model(path)
    with pytest.raises(ModelLoadError, match=f"tensor {up} is [A-Z0-9_]+; only float tensors"):
        iter_weights(source, load_model_config(source))


def test_float16_and_float64_tensors_are_widened(tiny_dirs, tmp_path):
    path = _copy_without_weights(tiny_dirs["untied"], tmp_path / "m")
    saved = load_file(os.path.join(tiny_dirs["untied"], "model.safetensors"))
    names = sorted(saved)
    mixed = {n: t.to(torch.float16 if i % 2 else torch.float64) for i, (n, t) in
             enumerate((n, saved[n]) for n in names)}
    save_file(mixed, os.path.join(path, "model.safetensors"))
    ours, _ = _load(path)
    for name, tensor in ours.items():
        assert torch.equal(tensor, mixed[name].float()), name


@pytest.mark.parametrize("keep", [20, 0.5], ids=["header", "data"])
def test_truncated_safetensors_names_the_file(tiny_dirs, tmp_path, keep):
    path = _copy_without_weights(tiny_dirs["untied"], tmp_path / "m")
    with open(os.path.join(tiny_dirs["untied"], "model.safetensors"), "rb") as f:
        data = f.read()
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    source = resolve_model(path)
    with pytest.raises(ModelLoadError, match="cannot read safetensors file .*model.safetensors"):
        list(iter_weights(source, load_model_config(source)))


# ---- a GGUF's mapping let go once its weights are read -------------------------------------

def _mapped(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(real) for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("quantized", [False, True])
def test_gguf_mapping_is_let_go_once_the_weights_are_read(tiny_dirs, tmp_path, quantized):
    """The config and the tokenizer parse the file once (one reader for all three); once
    every tensor is read the mapping, whose pages the read touched, goes: it held the whole
    file in each worker's memory for its life. What is yielded are copies, still whole."""
    from shared.tokenizer import load_tokenizer
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tiny_dirs["untied"], Q.Q8_0)
    source = resolve_model(gguf)
    config = load_model_config(source)
    load_tokenizer(source)
    weights = iter_weights(source, config, progress=False, quantized=quantized)
    assert _mapped(gguf)
    got = dict(weights)
    del weights
    assert not _mapped(gguf)
    again = dict(iter_weights(source, load_model_config(source), progress=False))
    for name, tensor in again.items():
        if not quantized:
            assert torch.equal(got[name], tensor), name
