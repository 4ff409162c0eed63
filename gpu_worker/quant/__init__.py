"""Quantized weights on CPU (`--quantization auto|none|int8|int4`).

    tensor.py  QTensor: codes + group-wise scales, from GGUF blocks or quantized from floats
    linear.py  the packed layouts and their GEMMs (torch's int4/int8 CPU kernels)

`resolve_quantization` turns the flag into one scheme for the model's matrices: `auto` serves a
GGUF in the precision it ships (int4 when its layer matrices have 4 bits or fewer: Q4_0, Q4_1,
Q4_K, Q3_K, Q2_K; int8 when a wider integer type is among them: Q8_0, Q6_K, Q5_K, Q5_0, Q5_1;
float when F32/F16/BF16; `shared/model_config.py quantization_scheme`) and an HF checkpoint as
it is. The vocabulary matrices (embedding and
LM head) are int8 per output channel under both schemes: the embedding looks rows up, which
the int4 layout cannot do. The refusals come before any weight is read.
"""
from __future__ import annotations

import structlog

from gpu_worker.cpu_kernels import best_level
from shared.errors import PacerError
from shared.model_config import ModelConfig, quantization_scheme
from shared.model_source import ModelSource

log = structlog.get_logger("quant")

CHOICES = ("auto", "none", "int8", "int4")
INT4_GROUP = 32


def resolve_quantization(requested: str, source: ModelSource, cfg: ModelConfig, tp: int = 1,
                         device: str = "cpu") -> str:
    """`none`, `int8` or `int4`; a PacerError that says why when the model cannot be served so."""
    if requested not in CHOICES:
        raise PacerError(f"--quantization must be one of {', '.join(CHOICES)}, got {requested!r}")
    scheme = quantization_scheme(requested, source, device)
    if scheme == "none":
        return scheme
    if device != "cpu":
        raise PacerError(f"--quantization {scheme}: quantized weights run on CPU only "
                         f"(device {device}); use --quantization none")
    if scheme == "int4":
        _check_int4_groups(cfg, tp)
    if best_level() == "generic":
        log.warning("this CPU runs no AVX2 (or PACER_CPU_ISA holds it at generic): integer "
                    "weights go through torch's baseline kernels, measured 5x (one row) to "
                    "80x (64 rows) slower than float32 weights; --quantization none widens "
                    "them (more memory)", quantization=scheme)
    return scheme


def _check_int4_groups(cfg: ModelConfig, tp: int) -> None:
    """int4 groups run along each matrix's input dimension, per rank: every input width (the
    row-parallel ones cut by tp) must divide into groups of INT4_GROUP."""
    widths = {"hidden_size": cfg.hidden_size,
              f"attention output input (heads · head_dim / tp={tp})":
                  cfg.num_heads * cfg.head_dim // tp,
              f"intermediate_size / tp={tp}": cfg.intermediate_size // tp}
    bad = {name: w for name, w in widths.items() if w % INT4_GROUP}
    if bad:
        said = ", ".join(f"{name} = {w}" for name, w in bad.items())
        raise PacerError(f"--quantization int4 needs every matrix's input width to divide into "
                         f"groups of {INT4_GROUP}, and {said} does not; use --quantization int8 "
                         f"or none")
