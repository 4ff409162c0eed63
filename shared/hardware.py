"""Hardware profiles for the roofline cost model: a sustained matmul rate per dtype, an HBM
(or DRAM) bandwidth, how fast small GEMMs run against that rate, and how much memory the
device holds.

Built-in profiles are round numbers for sustained rates, not vendor peaks. `h100` is the
pair of the hand-worked figures (docs/design.md#reference-figures): ~500 TFLOP/s for fp16
GEMMs and 3.35 TB/s, so its ridge point is ~150 FLOPs/byte. A profile written by `pacer
calibrate` is a JSON file with the same fields plus the raw measurements; `load_hardware`
reads either.

Stdlib only: the scheduler core imports this.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from shared.errors import PacerError
from shared.json_file import read_json_object

FLOAT32 = "float32"
HALF_DTYPES = ("bfloat16", "float16")   # either one stands for "16-bit tensor-core rate"


@dataclass(frozen=True)
class HardwareProfile:
    """Sustained matmul TFLOP/s per dtype name and memory bandwidth in TB/s (10**12 B/s).

    `gemm_half_rows`: the GEMM efficiency curve by rows (docs/design.md#small-chunks-run-below-peak):
    a matmul over M rows runs at `tflops · M / (M + gemm_half_rows)`, half the rate at
    M = gemm_half_rows; 0 means every matmul at the full rate. `memory_gib`: what the device
    holds (HBM, or RAM for a CPU), for the KV capacity; None when unknown.
    `interconnect_gb_per_s`: what one device's link to its tensor-parallel peers carries in
    one direction, in GB/s (10**9 B/s), for the all-reduces of --tp; None when unknown."""

    name: str
    tflops: Mapping[str, float]
    bandwidth_tbps: float
    measured_at: str | None = None
    measurements: Mapping[str, Any] = field(default_factory=dict, compare=False)
    gemm_half_rows: float = 0.0
    memory_gib: float | None = None
    interconnect_gb_per_s: float | None = None

    def __post_init__(self) -> None:
        if not self.tflops:
            raise PacerError(f"hardware profile {self.name!r} has no tflops")
        for dtype, rate in self.tflops.items():
            _check_positive(f"{self.name}: tflops[{dtype}]", rate)
        _check_positive(f"{self.name}: bandwidth_tbps", self.bandwidth_tbps)
        if not (isinstance(self.gemm_half_rows, (int, float)) and math.isfinite(self.gemm_half_rows)
                and self.gemm_half_rows >= 0):
            raise PacerError(f"{self.name}: gemm_half_rows must be a number >= 0, "
                             f"got {self.gemm_half_rows!r}")
        if self.memory_gib is not None:
            _check_positive(f"{self.name}: memory_gib", self.memory_gib)
        if self.interconnect_gb_per_s is not None:
            _check_positive(f"{self.name}: interconnect_gb_per_s", self.interconnect_gb_per_s)

    @property
    def memory_bytes(self) -> float | None:
        return None if self.memory_gib is None else self.memory_gib * 2**30

    def flops_per_s(self, dtype_bytes: float) -> float:
        """The matmul rate for operands of `dtype_bytes`: 4+ bytes use float32, anything
        narrower (fp16/bf16, or quantized weights widened to 16 bits) the 16-bit rate."""
        wanted = (FLOAT32,) if dtype_bytes >= 4 else HALF_DTYPES
        for name in wanted:
            if name in self.tflops:
                return self.tflops[name] * 1e12
        # A profile that lacks the dtype: the best rate it knows is the honest fallback.
        return max(self.tflops.values()) * 1e12

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_tbps * 1e12

    def ridge(self, dtype_bytes: float = 2) -> float:
        """FLOPs per byte above which an iteration is compute-bound
        (docs/design.md#the-roofline-cost-model)."""
        return self.flops_per_s(dtype_bytes) / self.bytes_per_s

    def with_overrides(self, tflops: float | None = None,
                       bandwidth_tbps: float | None = None) -> HardwareProfile:
        """`--hw-tflops X` sets every dtype's rate to X; `--hw-bandwidth-tbps Y` the bandwidth."""
        name = self.name
        new = self
        if tflops is not None:
            new = replace(new, tflops={d: tflops for d in self.tflops})
            name += f" @{tflops:g}TF"
        if bandwidth_tbps is not None:
            new = replace(new, bandwidth_tbps=bandwidth_tbps)
            name += f" @{bandwidth_tbps:g}TB/s"
        return replace(new, name=name)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tflops": dict(self.tflops),
                "bandwidth_tbps": self.bandwidth_tbps, "gemm_half_rows": self.gemm_half_rows,
                "memory_gib": self.memory_gib,
                "interconnect_gb_per_s": self.interconnect_gb_per_s, "measured_at": self.measured_at,
                "measurements": dict(self.measurements)}


def _check_positive(what: str, value: Any) -> None:
    # JSON's true is a Python int: a profile's `"bandwidth_tbps": true` read as 1 TB/s
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or value <= 0):
        raise PacerError(f"{what} must be a positive number, got {value!r}")


# Sustained dense rates. H100 SXM: the pair of docs/design.md#reference-figures, 80 GiB.
# H200: the same compute die with 141 GiB of HBM3e at 4.8 TB/s. A100 SXM 80GB: ~80% of its
# 312 TFLOP/s bf16 peak, 2.0 TB/s HBM2e. float32 rates are the non-tensor-core vendor figures.
# GEMM_HALF_ROWS: a round estimate, not a measurement (`pacer calibrate` fits it where it runs):
# a GEMM of 256 rows at 80 % of the sustained rate, 2,048 rows at 97 %; below ~150 rows a
# 7B model's GEMMs are memory-bound on these GPUs anyway.
# Interconnect: NVIDIA's datasheets give NVLink's total over both directions per GPU, 900 GB/s
# for H100 and H200 SXM (NVLink 4) and 600 GB/s for A100 SXM (NVLink 3); a ring all-reduce
# sends one way round the ring, so half of it: 450 and 300 GB/s, vendor peaks (NCCL reaches
# ~80 % of them on large messages, less on the small ones of a decode).
GEMM_HALF_ROWS = 64.0
HARDWARE: dict[str, HardwareProfile] = {
    "h100": HardwareProfile("h100", {"bfloat16": 500.0, "float16": 500.0, FLOAT32: 67.0}, 3.35,
                            gemm_half_rows=GEMM_HALF_ROWS, memory_gib=80.0,
                            interconnect_gb_per_s=450.0),
    "h200": HardwareProfile("h200", {"bfloat16": 500.0, "float16": 500.0, FLOAT32: 67.0}, 4.8,
                            gemm_half_rows=GEMM_HALF_ROWS, memory_gib=141.0,
                            interconnect_gb_per_s=450.0),
    "a100": HardwareProfile("a100", {"bfloat16": 250.0, "float16": 250.0, FLOAT32: 19.5}, 2.0,
                            gemm_half_rows=GEMM_HALF_ROWS, memory_gib=80.0,
                            interconnect_gb_per_s=300.0),
}


def hardware_from_dict(data: Mapping[str, Any], default_name: str = "calibrated") -> HardwareProfile:
    """A profile from the JSON object `pacer calibrate` writes."""
    tflops = data.get("tflops")
    if isinstance(tflops, (int, float)):
        tflops = {"bfloat16": float(tflops), FLOAT32: float(tflops)}
    if not isinstance(tflops, Mapping) or "bandwidth_tbps" not in data:
        raise PacerError("a hardware profile needs 'tflops' (per dtype) and 'bandwidth_tbps'")
    measurements = data.get("measurements") or {}
    if not isinstance(measurements, Mapping):
        raise PacerError(f"a hardware profile's 'measurements' must be an object, got "
                         f"{type(measurements).__name__}")
    return HardwareProfile(
        name=str(data.get("name") or default_name),
        tflops={str(k): v for k, v in tflops.items()},
        bandwidth_tbps=data["bandwidth_tbps"],
        measured_at=data.get("measured_at"),
        measurements=dict(measurements),
        gemm_half_rows=data.get("gemm_half_rows") or 0.0,
        memory_gib=data.get("memory_gib"),
        interconnect_gb_per_s=data.get("interconnect_gb_per_s"),
    )


def load_hardware(spec: str) -> HardwareProfile:
    """A built-in name (h100, h200, a100) or the path of a JSON profile."""
    if spec.lower() in HARDWARE:
        return HARDWARE[spec.lower()]
    if not os.path.isfile(spec):
        raise PacerError(f"unknown hardware {spec!r}: use one of {', '.join(HARDWARE)} "
                         "or a JSON file written by `pacer calibrate`")
    data = read_json_object(spec, "hardware profile")
    return hardware_from_dict(data, default_name=os.path.basename(spec))
