#!/usr/bin/env bash
# Installs torch ($TORCH_SPEC, default torch==2.13.0) into the environment of the Python given as $1, on its own and
# before anything that depends on it, so that no other requirement pulls a build of its choosing.
#
#   TORCH_INDEX unset     a machine with an NVIDIA GPU (nvidia-smi lists one): the default index (PyPI's CUDA build);
#                         without one: PyTorch's CPU index, with short time-outs so that a machine that cannot reach
#                         it does not stall; then the default index, but only if what it offers is a CPU build (PyPI's
#                         Linux wheels are CUDA builds of several GB: those stop here with a one-line message)
#   TORCH_INDEX=URL       that index (a mirror, or another CPU index)
#   TORCH_INDEX=default   the default index, whatever build it serves
#
# Used by the Makefile (make install / demo / test) and tests/vllm/setup_venv.sh.
set -euo pipefail
PY=$1
SPEC=${TORCH_SPEC:-torch==2.13.0}
INDEX=${TORCH_INDEX:-}
CPU_INDEX=https://download.pytorch.org/whl/cpu
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)

if [ "$INDEX" = default ]; then
    exec "${PIP[@]}" "$SPEC"
elif [ -n "$INDEX" ]; then
    exec "${PIP[@]}" "$SPEC" --index-url "$INDEX"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    echo "install_torch: an NVIDIA GPU: $SPEC from the default index (its CUDA build)"
    exec "${PIP[@]}" "$SPEC"
fi

echo "install_torch: no NVIDIA GPU: $SPEC, CPU build"
if "${PIP[@]}" "$SPEC" --index-url "$CPU_INDEX" --timeout 15 --retries 1; then
    exit 0
fi
echo "install_torch: PyTorch's CPU index ($CPU_INDEX) cannot be reached; asking the default index what it offers"
report=$("$PY" -m pip install --quiet --disable-pip-version-check --dry-run --ignore-installed --report - "$SPEC")
if printf '%s' "$report" | "$PY" -c '
import json, sys
names = [p["metadata"]["name"].lower() for p in json.load(sys.stdin)["install"]]
sys.exit(1 if any(n.startswith("nvidia-") for n in names) else 0)'; then
    exec "${PIP[@]}" "$SPEC"
fi
echo "install_torch: the default index offers a CUDA build of $SPEC (several GB) and PyTorch's CPU index cannot be" \
     "reached: pass TORCH_INDEX=<a CPU index or mirror>, or TORCH_INDEX=default to take the CUDA build" >&2
exit 1
