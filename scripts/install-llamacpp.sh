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
# Built without llama.cpp's AMX path: where the CPU has AMX (Sapphire and Emerald Rapids) its matmul died with
# SIGILL on the first prompt of more than one token (`tilezero` in an OpenMP worker whose tiles were not configured;
# the in-process Llama runs with use_extra_bufts off, the server cannot), so a llama.cpp replica restarted forever.
# -mno-amx-* wins over the build's -march=native whatever their order. A wheel pip cached from a build before this
# change is reused as it is: `pip cache remove llama_cpp_python` first.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "llama-cpp-python[server]==$VERSION"
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server.app; print('llama-cpp-python', llama_cpp.__version__, 'in', '$VENV')"
touch "$VENV/.installed"
