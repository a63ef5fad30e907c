#!/usr/bin/env bash
# Idempotent podman set-up for running conveyor's compose file with podman-compose on a Debian/Ubuntu
# host that has no Docker engine (see docs/deployment.md, "Podman").
#
# On restricted hosts (VMs, CI runners) podman works with four settings, which this script makes:
#   1. runc with cgroupfs (crun refuses hybrid cgroup set-ups),
#   2. lowered container ulimits (where CAP_SYS_RESOURCE is withheld, raising nofile/nproc fails),
#   3. host networking (containers reach each other on 127.0.0.1: compose/podman-override.yml),
#   4. the host's CA bundle mounted into builds (passed by the caller of `podman-compose build`).
# For hosts that reach no image registry, a base image is built locally once with debootstrap (Debian
# bookworm + python3, venv, pip), under a name of its own, localhost/conveyor-base:3.11 (never the
# official python image's name, which would shadow the real one in later builds on this machine):
# build with CONVEYOR_BASE_IMAGE=localhost/conveyor-base:3.11 (docker-compose.yml passes it on).
#
# Needs root and apt. Safe to run again: every step is skipped when already done.
# Exit status: 0 when podman, runc, podman-compose and the base image are all there; non-zero otherwise.
set -euo pipefail

BASE_IMAGE="localhost/conveyor-base:3.11"

log() { printf 'podman-setup: %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
    log "must run as root (apt-get, /etc/containers, podman import)"
    exit 2
fi

# 1. Packages.
missing=()
for cmd in podman runc debootstrap; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        log "missing ${missing[*]} and no apt-get to install them"
        exit 3
    fi
    log "installing podman runc debootstrap"
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get update -q
    timeout 900 apt-get install -y -q podman runc debootstrap
fi

# 2. containers.conf: runc + cgroupfs, lowered ulimits, host network namespace by default.
conf=/etc/containers/containers.conf
wanted='[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
netns = "host"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"'
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$wanted" ]; then
    log "writing $conf"
    mkdir -p /etc/containers
    if [ -f "$conf" ]; then cp -p "$conf" "$conf.bak.$(date +%s)"; fi
    printf '%s\n' "$wanted" > "$conf"
fi

# 3. podman-compose (a Python package; installed for the interpreter that runs this script's caller).
PYTHON="${PYTHON:-python3}"
if ! command -v podman-compose >/dev/null 2>&1; then
    log "installing podman-compose with $PYTHON -m pip"
    timeout 300 "$PYTHON" -m pip install -q podman-compose
fi
command -v podman-compose >/dev/null 2>&1 || { log "podman-compose not on PATH after install"; exit 4; }

# 4. The base image, built once per machine.
if ! podman image exists "$BASE_IMAGE"; then
    mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    rootfs=$(mktemp -d /var/tmp/conveyor-base-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrapping bookworm into $rootfs from $mirror (about a minute)"
    timeout 900 debootstrap --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$mirror" >/dev/null
    log "importing $BASE_IMAGE"
    tar -C "$rootfs" -c . | podman import - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
fi

log "ready: $(podman --version), $(podman-compose --version 2>/dev/null | head -n1)"
