#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): parity on a tiny random Llama, decode (CUDA graphs on and
# off) and prefill speed of a random-weight Llama-3-8B-shaped model beside the roofline, and that
# model served vs in-process (needs redis-server); one JSON file.
#
#   bench/gpu_check.sh                                   # cuda, writes docs/gpu_check.json
#   bench/gpu_check.sh --device cpu --out /tmp/s.json    # smoke mode (tiny shapes; CI)
#
# Needs torch (with CUDA), transformers and, for our kernel, triton; nothing is downloaded.
# PYTHON picks the interpreter. Bounded by 480 s (the H200 budget is 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
args=("$@")
[[ " $* " == *" --out "* ]] || args+=(--out docs/gpu_check.json)
if [[ " $* " != *" --device cpu "* ]] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec timeout 480 "$PY" -m bench.gpu_check "${args[@]}"
