#!/usr/bin/env bash
# llama.cpp's OpenAI server (llama-cpp-python[server]) in a virtual environment of its own, for deployments with
# `runtime.engine: llama.cpp`:
#     scripts/install-llamacpp.sh [VENV]        (default: .venv-llamacpp; then runtime.python: VENV/bin/python)
# pip builds llama.cpp from source for this CPU: 11-45 minutes on 2 cores. pip keeps the built wheel in its cache
# (outside the repo), so installing it again, into another venv, takes seconds.
set -euo pipefail
VENV=${1:-.venv-llamacpp}
VERSION=0.3.36
if [ -f "$VENV/.installed" ]; then
    echo "$VENV has llama-cpp-python already"; exit 0
fi
python3.11 -m venv "$VENV"
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$VENV/bin/pip" install --quiet --disable-pip-version-check \
    "llama-cpp-python[server]==$VERSION"
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server.app; print('llama-cpp-python', llama_cpp.__version__, 'in', '$VENV')"
touch "$VENV/.installed"
