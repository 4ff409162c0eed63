#!/usr/bin/env bash
# Make Docker usable on a CI runner or dev box without an image registry:
# install the Debian packages if missing, then start dockerd without a
# bridge or iptables (the sandbox forbids both) and wait until it answers.
set -euo pipefail

log() { printf '[docker_setup] %s\n' "$*"; }

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need_pkgs+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)
if ((${#need_pkgs[@]})); then
    log "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if docker info >/dev/null 2>&1; then
    log "dockerd already running"
    exit 0
fi

log_file="${DOCKERD_LOG:-/var/log/dockerd.log}"
log "starting dockerd (log: $log_file)"
nohup dockerd --bridge=none --iptables=false >"$log_file" 2>&1 &

for _ in $(seq 1 60); do
    if docker info >/dev/null 2>&1; then
        log "dockerd is up"
        exit 0
    fi
    sleep 1
done
log "dockerd did not answer within 60 s; last log lines:"
tail -n 20 "$log_file" >&2 || true
exit 1
