"""Reading a model's weights one tensor at a time, as float32 CPU tensors in HF layout.

With `quantized=True`, GGUF's Q4_0, Q4_1 and Q8_0 matrices come as they are stored instead:
a QTensor of integer codes and scales (gpu_worker/quant/tensor.py), never widened to float.

Names follow HF's LlamaForCausalLM (`model.layers.3.self_attn.q_proj.weight`), so the model
code knows one naming scheme whatever the file format. Every name and shape is checked
against the config before the first tensor is read: a bad file fails fast and says why.
"""
from __future__ import annotations

import glob
import os
import re
import sys
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from tqdm import tqdm

from gpu_worker.quant.tensor import GGUF_QUANT_TYPES, QTensor, from_gguf
from shared.errors import ModelLoadError
from shared.model_config import (GGUF_CONFIG_TENSORS, ModelConfig, forget_gguf_readers,
                                 open_gguf, read_json)
from shared.model_source import ModelSource

_SUPPORTED_GGUF_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))

_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}
_GGUF_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                     "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                     "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                     "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                     "ffn_norm": "post_attention_layernorm"}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a llama (or Qwen2: Q, K and V biases too) checkpoint must hold, by HF
    name."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_rows, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_rows, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_rows, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_rows),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
        })
        if c.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_rows,),
                           p + "self_attn.k_proj.bias": (kv_rows,),
                           p + "self_attn.v_proj.bias": (kv_rows,)})
    return shapes


def iter_weights(source: ModelSource, config: ModelConfig, progress: bool = True,
                 quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QTensor]]:
    """(HF name, float32 CPU tensor) pairs, one tensor in memory at a time; with `quantized`,
    a GGUF's quantized matrices as QTensors. Names, shapes and GGUF types are checked before
    this returns: a ModelLoadError comes before any tensor."""
    if source.kind == "gguf":
        return _iter_gguf(source.path, config, progress, quantized)
    return _iter_safetensors(source.path, config, progress)


def _check_names(found: dict[str, tuple[int, ...]], config: ModelConfig, where: str) -> None:
    expected = expected_shapes(config)
    unknown = sorted(set(found) - set(expected))
    missing = sorted(set(expected) - set(found))
    if unknown or missing:
        raise ModelLoadError(f"{where}: tensors do not match a llama with this config "
                             f"(unexpected: {unknown[:5]}, missing: {missing[:5]})")
    for name, shape in found.items():
        if tuple(shape) != expected[name]:
            raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(shape)}, "
                                 f"expected {expected[name]}")


def _progress(total: int, enabled: bool) -> tqdm:
    # a bar at a terminal only: into a file or a pipe it would break the JSON log lines
    return tqdm(total=total, desc="loading weights", unit="tensor", file=sys.stderr,
                disable=not enabled or not sys.stderr.isatty(), leave=False)


# ---- safetensors --------------------------------------------------------------------------

def _skipped(name: str, config: ModelConfig) -> bool:
    # old checkpoints save rotary buffers; tied checkpoints sometimes save the head anyway
    return name.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and name == "lm_head.weight")


# the float types a safetensors tensor may have: each is widened to float32 exactly (float64
# rounded); an integer, boolean or float8 tensor is a quantized or foreign checkpoint, whose
# values cast to float would be wrong weights
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
INDEX_FILE = "model.safetensors.index.json"


def _safe_open(file: str):
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # SafetensorError on a truncated or damaged file, OSError, ...
        raise ModelLoadError(f"cannot read safetensors file {file}: {type(e).__name__}: {e}") \
            from e


def _indexed_files(path: str) -> dict[str, str] | None:
    """HF's shard index: tensor name -> the file that holds it (joined to `path`); None where
    the directory has none. Only the files it names are read: a directory may hold others
    (Mistral's consolidated.safetensors beside the HF shards, a stale file from an earlier
    download) whose tensors are no part of this checkpoint."""
    file = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(file):
        return None
    weight_map = read_json(file).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        raise ModelLoadError(f"{file}: has no weight_map of tensor names to files")
    missing = sorted({v for v in weight_map.values()
                      if not os.path.isfile(os.path.join(path, v))})
    if missing:
        raise ModelLoadError(f"{file}: names shard files that are not in {path}: "
                             f"{', '.join(missing)}")
    return {name: os.path.join(path, v) for name, v in weight_map.items()}


def _iter_safetensors(path: str, config: ModelConfig,
                      progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    indexed = _indexed_files(path)
    files = sorted(set(indexed.values()) if indexed is not None
                   else glob.glob(os.path.join(path, "*.safetensors")))
    index: dict[str, str] = {}        # name -> file
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with _safe_open(file) as f:
            for name in f.keys():
                if _skipped(name, config) or (indexed is not None
                                              and indexed.get(name) != file):
                    continue
                if name in index:
                    raise ModelLoadError(f"{path}: tensor {name} is in both "
                                         f"{os.path.basename(index[name])} and "
                                         f"{os.path.basename(file)}; which one is meant is "
                                         f"not known (remove the stale file)")
                tensor = f.get_slice(name)
                if tensor.get_dtype() not in _FLOAT_DTYPES:
                    raise ModelLoadError(f"{file}: tensor {name} is {tensor.get_dtype()}; only "
                                         f"float tensors ({', '.join(_FLOAT_DTYPES)}) are read")
                index[name] = file
                shapes[name] = tuple(tensor.get_shape())
    if indexed is not None:
        absent = sorted(n for n, file in indexed.items()
                        if n not in index and not _skipped(n, config))
        if absent:
            raise ModelLoadError(f"{path}: {INDEX_FILE} puts tensor {absent[0]} in "
                                 f"{os.path.basename(indexed[absent[0]])}, which does not "
                                 f"hold it")
    _check_names(shapes, config, path)
    return _safetensors_tensors(files, index, progress)


def _safetensors_tensors(files: list[str], index: dict[str, str],
                         progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    with _progress(len(index), progress) as bar:
        for file in files:
            with _safe_open(file) as f:
                for name in (n for n in f.keys() if index.get(n) == file):
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as e:  # the data cut short after a whole header
                        raise ModelLoadError(f"cannot read tensor {name} from {file}: "
                                             f"{type(e).__name__}: {e}") from e
                    yield name, tensor.to(torch.float32)
                    bar.update()


# ---- GGUF ---------------------------------------------------------------------------------

def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = _GGUF_LAYER.fullmatch(gguf_name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. HF rotates halves of each head (rotate_half); GGML
    rotates adjacent pairs, so the converter interleaves each head's two halves:
    w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2). This is its inverse."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _check_gguf(reader: GGUFReader, config: ModelConfig, path: str) -> None:
    shapes = {}
    for t in reader.tensors:
        if t.name in GGUF_CONFIG_TENSORS:       # read by load_model_config
            continue
        name = hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {t.name} has no place in a llama model")
        if t.tensor_type not in _SUPPORTED_GGUF_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} is {t.tensor_type.name}; supported types "
                                 f"are {', '.join(q.name for q in _SUPPORTED_GGUF_TYPES)}")
        shapes[name] = tuple(int(d) for d in reversed(t.shape))   # GGUF lists dims fastest-first
    _check_names(shapes, config, path)


def _iter_gguf(path: str, config: ModelConfig, progress: bool,
               quantized: bool) -> Iterator[tuple[str, torch.Tensor | QTensor]]:
    reader = open_gguf(path)
    _check_gguf(reader, config, path)
    return _gguf_tensors(reader, config, progress, quantized)


def _unpermute_order(rows: int, n_heads: int) -> torch.Tensor:
    """_unpermute as a row order, for codes and scales alike."""
    return torch.from_numpy(_unpermute(np.arange(rows).reshape(rows, 1), n_heads)[:, 0].copy())


def _gguf_tensors(reader: GGUFReader, config: ModelConfig, progress: bool,
                  quantized: bool) -> Iterator[tuple[str, torch.Tensor | QTensor]]:
    # llama.cpp's converter reorders Llama's Q and K rows (see _unpermute), not Qwen2's
    permuted = config.architecture == "llama"
    with _progress(len(reader.tensors), progress) as bar:
        for t in reader.tensors:
            if t.name in GGUF_CONFIG_TENSORS:
                bar.update()
                continue
            name = hf_name(t.name)
            shape = tuple(int(d) for d in reversed(t.shape))
            if quantized and t.tensor_type in GGUF_QUANT_TYPES and len(shape) == 2:
                q = from_gguf(t.data, t.tensor_type, shape)
                if permuted and name.endswith("q_proj.weight"):
                    q = q.permute_rows(_unpermute_order(shape[0], config.num_heads))
                elif permuted and name.endswith("k_proj.weight"):
                    q = q.permute_rows(_unpermute_order(shape[0], config.num_kv_heads))
                yield name, q
                bar.update()
                continue
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if permuted and name.endswith("q_proj.weight"):
                w = _unpermute(w, config.num_heads)
            elif permuted and name.endswith("k_proj.weight"):
                w = _unpermute(w, config.num_kv_heads)
            if not (w.flags.writeable and w.flags.c_contiguous):   # F32 is a view of the mmap
                w = np.array(w, order="C")
            yield name, torch.from_numpy(w)
            bar.update()
    # every tensor is a copy (dequantized, unpermuted or copied above; QTensors too), so the
    # file's mapping can go; this generator's own `reader` goes as it returns
    forget_gguf_readers()
