#!/usr/bin/env bash
# What bench/gpu_check.sh needs on a GPU machine that has torch, Triton and transformers but
# no network (docs/gpu.md#the-prepared-check-bench-gpu_checksh): the pure-Python wheels it
# lacks and a redis-server with the libraries it links that such an image may not have.
# Run here, carry the folder there, then:
#
#   bench/offline_bundle.sh .bundle            # here (pip must reach a package index)
#   # there, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .bundle/*.whl
#   export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.bundle:$PATH LD_LIBRARY_PATH=$PWD/.bundle
#   bash bench/gpu_check.sh --profile
set -euo pipefail
out=${1:?usage: bench/offline_bundle.sh FOLDER}
py=${PYTHON:-python3}
mkdir -p "$out"
# pure Python: one wheel serves any CPython 3 on the other side
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$out" redis structlog gguf
server=$(command -v redis-server) || { echo "redis-server is not installed here" >&2; exit 1; }
cp "$server" "$out/"
# the libraries redis-server links beyond what a CUDA base image usually holds
for lib in liblzf.so.1 libjemalloc.so.2; do
    path=$(ldd "$server" | awk -v l="$lib" '$1 == l {print $3}')
    [[ -n "$path" ]] && cp "$path" "$out/"
done
ls -la "$out"
