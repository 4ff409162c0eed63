"""The shape of the model, read from config.json or GGUF metadata: Llama, Mistral (the same
network) within its sliding window, and Qwen2 (the same with biases on Q, K and V).

RoPE is plain, or scaled the way Llama 3.1/3.2 (`llama3`) or a linearly stretched checkpoint
(`linear`) asks in its config.json or GGUF: both only change the rotary frequencies
(docs/design.md#model-families-and-rope-scaling). Every other scaling (dynamic, yarn,
longrope) is refused rather than ignored: a model run with the wrong rotary frequencies still
produces fluent-looking text that is subtly wrong.
"""
from __future__ import annotations

import functools
import inspect
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from shared.errors import ModelLoadError, PacerError
from shared.model_source import ModelSource

_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                     "qwen2": "Qwen2ForCausalLM"}
_SLIDING = ("mistral", "qwen2")      # model types whose config may set an attention window


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE's frequencies (transformers' `rope_type` of the same
    name): `linear` divides every frequency by `factor`; `llama3` divides the low ones (a
    wavelength over original / low_freq_factor positions) by `factor`, keeps the high ones
    (under original / high_freq_factor) and blends those between."""
    kind: str                                  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def scale(self, inv_freq, where):
        """RoPE's inverse frequencies `inv_freq` so scaled, in transformers' operations in
        its order (the same bits in float32): the one formula, for the worker's torch tensors
        (`where` is torch.where) and for checking a GGUF's divisors with numpy (np.where)."""
        if self.kind == "linear":
            return inv_freq / self.factor
        old = self.original_max_position_embeddings
        low, high, factor = self.low_freq_factor, self.high_freq_factor, self.factor
        wavelen = 2 * math.pi / inv_freq
        scaled = where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return where(medium, smoothed, scaled)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...] = ()   # every id that ends generation, eos_token_id first
    rope_scaling: RopeScaling | None = None
    # Mistral, Qwen2: the attention window, when it is what max_position_embeddings was cut to
    sliding_window: int | None = None
    qkv_bias: bool = False                # Qwen2: the Q, K and V projections have biases

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1:
            raise ModelLoadError(f"num_kv_heads must be a positive integer, got "
                                 f"{self.num_kv_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads={self.num_heads} is not a multiple of "
                                 f"num_kv_heads={self.num_kv_heads}")


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        return _from_gguf(source.path)
    return _from_hf_dir(source.path)


def eos_token_ids(source: ModelSource) -> tuple[int, ...]:
    """Every id the model files say ends generation, the primary eos first: GGUF eos, eot and
    eom ids; HF config.json's eos_token_id plus generation_config.json's (int or list) plus
    tokenizer_config.json's eos_token. The one place the set is computed: the scheduler stops
    on it (ModelConfig.eos_token_ids) and the tokenizer reports it."""
    if source.kind == "gguf":
        return _gguf_eos_ids(open_gguf(source.path), source.path)
    return _hf_eos_ids(source.path)


# ---- HF directory -------------------------------------------------------------------------

def read_text(path: str) -> str:
    """A model file's UTF-8 text; one that cannot be read or decoded is named."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def read_json(path: str) -> dict:
    try:
        return json.loads(read_text(path))
    except ValueError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def read_json_object(path: str) -> dict:
    """read_json of a file whose fields are read (config.json, tokenizer_config.json): any
    other JSON value is refused here, not met as an AttributeError on its first field."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: is a JSON {type(data).__name__}, not an object of fields")
    return data


def _from_hf_dir(path: str) -> ModelConfig:
    file = os.path.join(path, "config.json")
    return _hf_config(path, file, read_json_object(file))


_REQUIRED = object()


def _positive_int(cfg: dict, key: str, file: str, default: Any = _REQUIRED) -> Any:
    """cfg[key], which must be a positive integer (4.0, "64" and true are not); `default`
    where it is absent or null."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"{file}: has no {key!r}")
        return default
    return _positive_count(value, key, file)


def _positive_count(value: Any, key: str, file: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{file}: {key} must be a positive integer, got {value!r}")
    return value


def _head_dim(given: int | None, hidden: int, heads: int, file: str, hidden_key: str,
              heads_key: str, head_dim_key: str) -> int:
    """The head size: `given`, else hidden / heads, which must divide evenly (8 split into 16
    heads would be heads of size 0, a model of nothing). It must be even: RoPE turns the
    head's dimensions in pairs, and an odd one would be left over."""
    if given is None:
        if hidden % heads:
            raise ModelLoadError(f"{file}: {hidden_key}={hidden} does not split evenly into "
                                 f"{heads_key}={heads} heads; {head_dim_key} must give the "
                                 "head size")
        given, said = hidden // heads, f"{hidden_key} / {heads_key} = {hidden} / {heads}"
    else:
        said = head_dim_key
    if given % 2:
        raise ModelLoadError(f"{file}: the head size ({said}) is {given}, odd; RoPE turns "
                             "dimensions in pairs, so it must be even")
    return given


def _positive_number(value: Any, key: str, file: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ModelLoadError(f"{file}: {key} must be a positive number, got {value!r}")
    return float(value)


def _object(cfg: dict, key: str, file: str) -> dict:
    """cfg[key], which must be an object (a dict); {} where it is absent or null."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ModelLoadError(f"{file}: {key} must be an object of fields, got {value!r}")
    return value


def _hf_config(path: str, file: str, cfg: dict) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelLoadError(f"{file}: model_type must be a string, got {model_type!r}")
    supported = ", ".join(f"{t} ({a})" for t, a in _HF_ARCHITECTURES.items())
    if model_type is None and not cfg.get("architectures"):   # nothing names the family
        raise ModelLoadError(f"{file}: has no model_type; supported: {supported}")
    architectures = cfg.get("architectures") or [
        _HF_ARCHITECTURES.get(model_type) or _HF_ARCHITECTURES["llama"]]
    if not isinstance(architectures, list):
        raise ModelLoadError(f"{file}: architectures must be a list, got {architectures!r}")
    if model_type is None and cfg.get("architectures"):
        # an older config names only its class (transformers' LlamaForCausalLM loads it): the
        # family is the one of that class, rather than a refusal of a supported class
        model_type = next((t for t, a in _HF_ARCHITECTURES.items() if a in architectures), None)
    expected = _HF_ARCHITECTURES.get(model_type)
    if expected is None or expected not in architectures:
        raise ModelLoadError(f"{file}: architecture {architectures[0]!r} (model_type "
                             f"{model_type!r}) is not supported; only {supported}")
    _check_hf_features(cfg, file)
    rope = _object(cfg, "rope_parameters", file)   # transformers 5 moved rope_theta in here
    hidden, heads = _positive_int(cfg, "hidden_size", file), \
        _positive_int(cfg, "num_attention_heads", file)
    eos = _hf_eos_ids(path)
    context = _positive_int(cfg, "max_position_embeddings", file, 2048)
    window = _positive_int(cfg, "sliding_window", file, None) if model_type in _SLIDING else None
    # Qwen2 says whether its window is used (off in Qwen2 and 2.5's configs); Mistral's is
    if window is not None and cfg.get("use_sliding_window", True) and window < context:
        # a query sees every key of a context no longer than the window: served exactly
        # (as plain attention) up to it, so that is the context this model gets
        context = window
    else:
        window = None
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ModelLoadError(f"{file}: tie_word_embeddings must be true or false, got {tied!r}")
    return ModelConfig(
        architecture=model_type,
        vocab_size=_positive_int(cfg, "vocab_size", file),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size", file),
        num_layers=_positive_int(cfg, "num_hidden_layers", file),
        num_heads=heads,
        num_kv_heads=_positive_int(cfg, "num_key_value_heads", file, heads),
        head_dim=_head_dim(_positive_int(cfg, "head_dim", file, None), hidden, heads, file,
                           "hidden_size", "num_attention_heads", "head_dim"),
        rope_theta=_positive_number(next((t for t in (cfg.get("rope_theta"),
                                                      rope.get("rope_theta")) if t is not None),
                                         10000.0), "rope_theta", file),
        rms_norm_eps=_positive_number(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", file),
        max_position_embeddings=context,
        tie_word_embeddings=tied,
        bos_token_id=(_ids(cfg.get("bos_token_id"), f"{file}: bos_token_id") or [None])[0],
        eos_token_id=eos[0] if eos else None,
        eos_token_ids=eos,
        rope_scaling=_hf_rope_scaling(cfg, file),
        sliding_window=window,
        qkv_bias=model_type == "qwen2",
    )


def _check_hf_features(cfg: dict, file: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ModelLoadError(f"{file}: {key}=true is not supported (llama without biases only)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{file}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")


def _hf_rope_scaling(cfg: dict, file: str) -> RopeScaling | None:
    """`rope_scaling` (transformers 4) or `rope_parameters` (5), whichever says more."""
    for key in ("rope_scaling", "rope_parameters"):
        scaling = _object(cfg, key, file)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            continue
        if kind not in ("linear", "llama3"):
            raise ModelLoadError(f"{file}: {key} of type {kind!r} is not supported (plain RoPE, "
                                 "linear or llama3 only)")
        # a factor of 0, below 0 or NaN gives infinite or NaN frequencies: fluent nonsense
        def number(name: str) -> float:
            return _positive_number(float(scaling[name]), f"{key}.{name}", file)
        try:
            factor = number("factor")
            if kind == "linear":
                return RopeScaling("linear", factor)
            low, high = number("low_freq_factor"), number("high_freq_factor")
            original = scaling.get("original_max_position_embeddings")
            original = int(cfg["max_position_embeddings"] if original is None else original)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ModelLoadError(f"{file}: {key} of type {kind!r} without a usable "
                                 f"{e.args[0] if isinstance(e, KeyError) else 'value'}: "
                                 f"{scaling}") from None
        if high <= low:         # llama3 blends the frequencies between by dividing by high - low
            raise ModelLoadError(f"{file}: {key}.high_freq_factor ({high:g}) must be above "
                                 f"its low_freq_factor ({low:g})")
        return RopeScaling("llama3", factor, low, high,
                           _positive_count(original, f"{key}.original_max_position_embeddings",
                                           file))
    return None


def _hf_eos_ids(path: str) -> tuple[int, ...]:
    file = os.path.join(path, "config.json")
    ids = _ids(read_json(file).get("eos_token_id"), f"{file}: eos_token_id")
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        gen = read_json(gen_file)
        ids += _ids(gen.get("eos_token_id") if isinstance(gen, dict) else None,
                    f"{gen_file}: eos_token_id")
    return tuple(dict.fromkeys(ids + _hf_tokenizer_eos_ids(path)))


def special_token_text(token: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _hf_tokenizer_eos_ids(path: str) -> list[int]:
    """tokenizer_config.json's eos_token as an id, as vLLM stops on it too: a ChatML
    fine-tune names <|im_end|> there while its config.json keeps the base model's eos. Looked
    up in the file's added_tokens_decoder, else among tokenizer.json's tokens (parsed only
    then: no tokenizer is built for this in the scheduler and every worker)."""
    file = os.path.join(path, "tokenizer_config.json")
    cfg = read_json(file) if os.path.isfile(file) else {}
    token = special_token_text(cfg.get("eos_token")) if isinstance(cfg, dict) else None
    if token is None:
        return []
    decoder = cfg.get("added_tokens_decoder")
    for token_id, added in (decoder.items() if isinstance(decoder, dict) else ()):
        if isinstance(added, dict) and added.get("content") == token and token_id.isdigit():
            return [int(token_id)]
    file = os.path.join(path, "tokenizer.json")
    tok = read_json(file) if os.path.isfile(file) else {}
    added = tok.get("added_tokens") if isinstance(tok, dict) else None
    for entry in (added if isinstance(added, list) else ()):
        if isinstance(entry, dict) and entry.get("content") == token \
                and isinstance(entry.get("id"), int):
            return [entry["id"]]
    model = tok.get("model") if isinstance(tok, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    found = vocab.get(token) if isinstance(vocab, dict) else None
    return [found] if isinstance(found, int) else []


def _ids(value: Any, where: str) -> list[int]:
    """A token id or a list of them (`where` names the field in an error)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelLoadError(f"{where} must be a token id or a list of them, got {value!r}")
    return ids


# ---- GGUF ---------------------------------------------------------------------------------

class _PlainViewReader(GGUFReader):
    """gguf-py's reader, its values sliced from a plain ndarray over the file's mapping.

    The reader builds every metadata value, each of a tokenizer's ~100k strings included, from
    two slices of its `np.memmap`; a memmap's slice runs Python (`__getitem__`,
    `__array_finalize__`) where an ndarray's does not. Slicing a plain view of the same mapping
    gives the same values and tensors (zero-copy still) in a quarter of the time: 0.5 s against
    2.0 s for the default model, paid by the gateway and by every worker as it starts.
    `_get` is the reader's one primitive read; `READER` falls back to gguf-py's own class
    should a release change its signature or `_get_field_parts`'.

    An array of strings or of numbers (the tokenizer's tokens, merges, scores and types) is
    read in one loop here rather than one recursive call per element: the same parts, in
    0.1 s instead of 0.5 for the default model (tests/test_weights.py compares every field
    with gguf-py's reader). Other arrays, and a file not in the machine's byte order, are
    gguf-py's to read.
    """

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        # "I" (the file's order is the machine's) leaves the dtype as it is
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
        nptype = self.gguf_scalar_to_np.get(itype)
        if itype != GGUFValueType.STRING and nptype is None:
            return super()._get_field_parts(orig_offs, raw_type)      # arrays of arrays
        plain, offs = self.__dict__["_plain"], orig_offs + 12        # set by _get
        parts = [raw_itype, alen]
        if itype == GGUFValueType.STRING:                 # each: a uint64 length, its bytes
            unpack, mem = struct.Struct("=Q").unpack_from, memoryview(plain)
            for _ in range(n):
                (length,) = unpack(mem, offs)
                parts += (plain[offs:offs + 8].view(np.uint64), plain[offs + 8:offs + 8 + length])
                offs += 8 + length
            data = list(range(3, 2 + 2 * n, 2))
        else:
            size = np.dtype(nptype).itemsize
            whole = plain[offs:offs + size * n].view(nptype)
            parts += [whole[i:i + 1] for i in range(n)]
            offs += size * n
            data = list(range(2, 2 + n))
        # gguf-py names the elements' type only where there is an element
        return offs - orig_offs, parts, data, [GGUFValueType.ARRAY, itype][:1 + (n > 0)]


def _reader_class() -> type[GGUFReader]:
    try:
        params = list(inspect.signature(GGUFReader._get).parameters)
        field_params = list(inspect.signature(GGUFReader._get_field_parts).parameters)
    except (AttributeError, TypeError, ValueError):
        return GGUFReader
    return _PlainViewReader if params == ["self", "offset", "dtype", "count", "override_order"] \
        and field_params == ["self", "orig_offs", "raw_type"] else GGUFReader


READER = _reader_class()


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    return READER(path)


def open_gguf(path: str) -> GGUFReader:
    """One parsed GGUF per file per process: the config, the tokenizer and the weights all read
    the same file, and parsing its ~100k tokenizer strings is most of a start-up's reading."""
    try:
        st = os.stat(path)
        return _cached_reader(os.path.realpath(path), st.st_mtime_ns, st.st_size)
    except Exception as e:  # gguf-py raises assorted errors on a damaged file
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def forget_gguf_readers() -> None:
    """Let go of the parsed GGUFs, and with the last reference their mapping and file: once
    the weights are read from it the mapping holds every page of the file the read touched,
    counted in the process's memory for its life (a 121 MB file, 121 MiB per worker). Whoever
    needs one later (a grammar's tokenizer) parses the file again."""
    _cached_reader.cache_clear()


def gguf_matrix_types(path: str) -> set[str]:
    """The GGUF types of the layer matrices (blk.*, two dimensions)."""
    return {t.tensor_type.name for t in open_gguf(path).tensors
            if t.name.startswith("blk.") and len(t.shape) == 2}


# GGUF's integer types by what serves them on CPU: 4 bits and fewer as int4, more as int8
_GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K"}
_GGUF_INT8 = {"Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"}


def quantization_scheme(requested: str, source: ModelSource, device: str) -> str:
    """What `--quantization` means for this model: `none`, `int8` or `int4`. `auto` serves a
    GGUF in the precision it ships on CPU (int4 when its layer matrices have 4 bits or fewer,
    int8 when a wider integer type is among them, as in a Q4_K_M file's Q6_K tensors; float
    when any is float), and anything else as it is. No checks: the worker's
    `resolve_quantization` refuses what cannot be served."""
    if requested != "auto":
        return requested
    if source.kind != "gguf" or device != "cpu":
        return "none"
    types = gguf_matrix_types(source.path)
    if types and types <= _GGUF_INT4:
        return "int4"
    if types and types <= _GGUF_INT4 | _GGUF_INT8:
        return "int8"       # a mix: the widest of its types
    return "none"


def gguf_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_token_id(reader: GGUFReader, key: str, path: str) -> int | None:
    """A special token's id (`key`: bos_token_id, eos_token_id, ...), if the file names one:
    a token of the vocabulary (a BOS beyond it would be put before every prompt and index
    past the embedding table). The model config and the tokenizer both read it here."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens.data) if tokens is not None else \
        gguf_value(reader, f"{gguf_value(reader, 'general.architecture')}.vocab_size")
    value = gguf_value(reader, f"tokenizer.ggml.{key}")
    [token_id] = _ids(value, f"{path}: tokenizer.ggml.{key}") or [None]
    if token_id is not None and isinstance(vocab_size, int) and token_id >= vocab_size:
        raise ModelLoadError(f"{path}: tokenizer.ggml.{key} is {token_id}, beyond the "
                             f"vocabulary of {vocab_size} tokens")
    return token_id


def _gguf_eos_ids(reader: GGUFReader, path: str) -> tuple[int, ...]:
    ids = (gguf_token_id(reader, key, path)
           for key in ("eos_token_id", "eot_token_id", "eom_token_id"))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _f32(value: float) -> float:
    """GGUF stores floats as float32; 1e-5 comes back as 9.99999974e-06. Recover the decimal
    the converter was given (the shortest repr of the float32)."""
    return float(str(np.float32(value)))


def _from_gguf(path: str) -> ModelConfig:
    reader = open_gguf(path)
    parts = gguf_value(reader, "split.count", 1)
    if isinstance(parts, int) and parts > 1:    # this part's tensors only: most are missing
        raise ModelLoadError(f"{path}: one part of a GGUF split in {parts} files; merge "
                             f"them into one (llama-gguf-split --merge) and give that")
    arch = gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported; only "
                             f"{', '.join(GGUF_ARCHITECTURES)}")
    tensor_names = {t.name for t in reader.tensors}

    def get(key: str, default: Any = None) -> Any:
        value = gguf_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata has no {arch}.{key}")
        return value

    def count(key: str, default: Any = None) -> int:
        """A positive integer (one value for all layers: a per-layer array is refused)."""
        value = get(key, default)
        if isinstance(value, list):
            raise ModelLoadError(f"{path}: per-layer values of {arch}.{key} are not supported")
        return _positive_count(value, f"{arch}.{key}", path)

    def number(key: str, default: Any = None) -> float:
        """A positive, finite float, as HF configs' rope_theta and rms_norm_eps must be: 0,
        below 0 or NaN gives infinite or NaN frequencies or norms, fluent nonsense."""
        return _f32(_positive_number(get(key, default), f"{arch}.{key}", path))

    hidden, heads = count("embedding_length"), count("attention.head_count")
    kv_heads = count("attention.head_count_kv", heads)
    given = gguf_value(reader, f"{arch}.attention.key_length")
    head_dim = _head_dim(None if given is None else count("attention.key_length"), hidden, heads,
                         path, f"{arch}.embedding_length", f"{arch}.attention.head_count",
                         f"{arch}.attention.key_length")
    theta = number("rope.freq_base", 10000.0)
    rope_scaling = _gguf_rope_scaling(reader, path, arch, head_dim, theta)
    eos = _gguf_eos_ids(reader, path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return ModelConfig(
        architecture=arch,
        vocab_size=len(tokens.data) if tokens is not None else count("vocab_size"),
        hidden_size=hidden,
        intermediate_size=count("feed_forward_length"),
        num_layers=count("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=count("context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=gguf_token_id(reader, "bos_token_id", path),
        eos_token_id=eos[0] if eos else None,
        eos_token_ids=eos,
        rope_scaling=rope_scaling,
        qkv_bias=arch == "qwen2",
    )


# GGUF architectures read: llama.cpp's converter writes Llama's Q and K rows in its own order
# (pairs of dimensions turned together), Qwen2's as they are
# (docs/design.md#model-families-and-rope-scaling)
GGUF_ARCHITECTURES = ("llama", "qwen2")

# GGUF tensors that are no weight of the network but part of its configuration
GGUF_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})


def _gguf_rope_scaling(reader: GGUFReader, path: str, arch: str, head_dim: int,
                       theta: float) -> RopeScaling | None:
    """`linear` from the metadata; `llama3` from the `rope_freqs` tensor llama.cpp's converter
    writes for it (each frequency's divisor), recognised as Llama 3's own parameters so that
    the frequencies are computed as transformers computes them."""
    key = f"{arch}.rope.dimension_count"
    rot = _positive_count(gguf_value(reader, key, head_dim), key, path)
    if rot != head_dim:
        raise ModelLoadError(f"{path}: partial rotary ({rot} of {head_dim} dims) is not supported")
    kind = gguf_value(reader, f"{arch}.rope.scaling.type", "none")
    factor = _f32(gguf_value(reader, f"{arch}.rope.scaling.factor", 1.0))
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is not None:
        key = f"{arch}.rope.scaling.original_context_length"
        original = gguf_value(reader, key)
        if original is not None:
            _positive_count(original, key, path)
        return _llama3_from_divisors(np.asarray(tensor.data, dtype=np.float64).ravel(), path,
                                     head_dim, theta, original)
    if kind in ("none", None) or factor == 1.0:
        return None
    if kind == "linear":
        return RopeScaling("linear", _positive_number(factor, f"{arch}.rope.scaling.factor", path))
    raise ModelLoadError(f"{path}: rope scaling {kind!r} is not supported (plain RoPE, linear or "
                         "llama3 only)")


def _llama3_from_divisors(divisors: np.ndarray, path: str, head_dim: int, theta: float,
                          original: int | None) -> RopeScaling:
    """The llama3 scaling whose per-frequency divisors these are. Llama 3.1 and 3.2 use low 1,
    high 4 and an original context of 8192 (what the converter assumes unless the metadata
    says otherwise); the factor is the largest divisor."""
    if divisors.shape != (head_dim // 2,):
        raise ModelLoadError(f"{path}: rope_freqs.weight has {divisors.size} values, not "
                             f"{head_dim // 2} (one per rotary pair)")
    factor = _positive_number(float(np.float32(divisors.max())),
                              "rope_freqs.weight's largest divisor (the factor)", path)
    scaling = RopeScaling("llama3", factor, 1.0, 4.0, int(original or 8192))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    old = scaling.original_max_position_embeddings
    if not np.allclose(divisors, inv_freq / scaling.scale(inv_freq, np.where), rtol=1e-4,
                       atol=0):
        raise ModelLoadError(f"{path}: rope_freqs.weight is no llama3 scaling of factor "
                             f"{scaling.factor:g} (low 1, high 4, original context {old}); "
                             "such frequencies are not supported")
    return scaling


def check_tp_fits(cfg: ModelConfig, tp: int) -> None:
    """Cuts fall on head boundaries (docs/design.md#tensor-parallelism): query and KV heads
    must both divide by tp. `cfg` may also be a cost model's ModelShape: its name starts the
    error, since `pacer cost` checks several models at once."""
    if tp < 1:
        raise PacerError(f"--tp must be >= 1, got {tp}")
    name = getattr(cfg, "name", None)
    model = f"{name}: " if name else ""
    if cfg.num_heads % tp or cfg.num_kv_heads % tp:
        raise PacerError(f"{model}tp={tp} does not divide the model's {cfg.num_heads} query heads "
                         f"and {cfg.num_kv_heads} KV heads (cuts must fall on head boundaries)")
    if cfg.intermediate_size % tp:
        raise PacerError(f"{model}tp={tp} does not divide the model's MLP width "
                         f"{cfg.intermediate_size}")
