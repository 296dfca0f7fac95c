#!/usr/bin/env bash
# Re-resolve constraints.txt: every package `make install` puts in .venv, at the version CI then tests.
# `make install`, the Docker images and CI install through it, so a release of a dependency (a new
# ONNX Runtime quantiser, a tokenizer change) cannot move the default bundle's answers or break CI
# until someone re-locks here and the tests pass on the new set.
#
#   bash scripts/lock.sh        # = make lock; about 100 s; then `make test` and commit constraints.txt
#
# It installs into a throwaway virtual environment, exactly as the Makefile does (the pinned CPU torch
# first), and freezes it. Each pin carries the interpreter it was resolved for (CPython 3.11 or later:
# the pinned numpy and scipy need it); elsewhere pip resolves freely, as without a lock.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
venv=$(mktemp -d)
tmp=$(mktemp constraints.txt.XXXXXX)  # beside it, so the last step is a rename; gone if a step fails
trap 'rm -rf "$venv" "$tmp"' EXIT
"$PY" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet -e '.[dev]'
version=$("$venv/bin/python" -c 'import platform; print(platform.python_version())')
{
  echo "# The versions CI tested, resolved by scripts/lock.sh (make lock) on $(date -u +%F) with CPython $version."
  echo "# Installed with pip's -c by make install, .ci/run and docker/; refresh with make lock, never by hand."
  # torch's local label (+cpu) is left off, so the CUDA build of the same release also satisfies the pin
  "$venv/bin/pip" freeze --exclude-editable | sed -e 's/+cpu$//' -e 's/$/ ; python_version >= "3.11"/'
} >"$tmp"
chmod 644 "$tmp" && mv "$tmp" constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) pins"
