#!/usr/bin/env bash
# Build and run coreply's images with podman (runc), as CI does: `make containers`.
#
#   base   a Debian bookworm base made by debootstrap (no registry is reachable), with the host's CA bundle
#          (HTTPS from inside a build is intercepted) and a pip.conf that trusts it
#   cpu    docker/Dockerfile on that base, torch from the local CPU wheel
#   gpu    docker/Dockerfile.gpu on that base with the CPU torch wheel standing in for the CUDA build:
#          every other step (apt, onnxruntime-gpu, faiss-gpu, the package) runs; CUDA itself does not
#   prom   a real Prometheus (Debian's package) for the compose check
#   test   tests/test_containers.py against the images: /readyz, /respond, /metrics, SIGTERM drain, and
#          the compose stack with Prometheus scraping coreply
#
# With no arguments: all of them, in that order. Needs root (apt-get, debootstrap, rootful podman).
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF="$PWD/docker/ci/containers.conf"
BASE=localhost/coreply-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELS=${TORCH_WHEELS:-/opt/wheels}   # a directory holding the torch==2.13.0 CPU wheel
PY=${PY:-.venv/bin/python}
export PATH="$PWD/.venv/bin:$PATH"   # podman-compose, installed into the venv

need() {
  local missing=()
  for tool in podman runc debootstrap iptables; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  if ((${#missing[@]})); then
    apt-get update >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      podman runc debootstrap iptables netavark aardvark-dns uidmap >/dev/null
  fi
  "$PY" -m pip show podman-compose >/dev/null 2>&1 || "$PY" -m pip install --quiet podman-compose==1.6.0
}

base() {
  if podman image exists "$BASE"; then echo "base: $BASE exists"; return; fi
  local root
  root=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR" >/dev/null
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$root/etc/pip.conf"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import --quiet - "$BASE" >/dev/null
  rm -rf "$root"
  echo "base: imported $BASE"
}

image_id() { podman image inspect "$1" --format '{{.Id}}' 2>/dev/null || true; }

drop_previous() {  # drop_previous TAG OLD_ID: the image TAG named before a rebuild, untagged now (each run
  # left 2-4 GB of them behind until the disk filled)
  if [ -n "$2" ] && [ "$2" != "$(image_id "$1")" ]; then podman rmi "$2" >/dev/null 2>&1 || true; fi
}

build() {  # build FILE TAG; the first stage, `build`, is tagged too (coreply-build:...): it is the next
  # build's cache (torch and the dependencies), and untagged each one stayed behind (2-4 GB a build)
  ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 \
    || { echo "no torch 2.13.0 CPU wheel in $WHEELS (set TORCH_WHEELS)" >&2; exit 1; }
  local start=$SECONDS old tag target stage
  for target in build final; do
    tag=$2 stage=()
    if [ "$target" = build ]; then tag=${2%%:*}-build:${2#*:} stage=(--target build); fi
    old=$(image_id "$tag")
    podman build --quiet --format docker -f "$1" -t "$tag" "${stage[@]}" \
      --build-arg BASE="$BASE" --build-arg TORCH_FROM="--find-links /wheels" \
      -v "$WHEELS:/wheels:ro" . >/dev/null
    drop_previous "$tag" "$old"
  done
  echo "$2: built from $1 in $((SECONDS - start)) s ($(podman image inspect "$2" --format '{{.Size}}') bytes)"
}

cpu() { build docker/Dockerfile coreply:cpu; }
gpu() { build docker/Dockerfile.gpu coreply:gpu-cpu-torch; }
prom() {
  local old
  old=$(image_id coreply-ci/prometheus)
  podman build --quiet --format docker -f docker/ci/Dockerfile.prometheus -t coreply-ci/prometheus . >/dev/null
  drop_previous coreply-ci/prometheus "$old"
  echo "prometheus image built"
}

run_tests() {
  COREPLY_IMAGE=coreply:cpu COREPLY_GPU_IMAGE=coreply:gpu-cpu-torch PROMETHEUS_IMAGE=coreply-ci/prometheus \
    "$PY" -m pytest -q tests/test_containers.py
}

need
if (($# == 0)); then set -- base cpu gpu prom test; fi
for step in "$@"; do
  case $step in
    base|cpu|gpu|prom) "$step" ;;
    test) run_tests ;;
    *) echo "unknown step '$step' (base, cpu, gpu, prom, test)" >&2; exit 2 ;;
  esac
done
