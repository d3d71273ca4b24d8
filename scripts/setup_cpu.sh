#!/usr/bin/env bash
# Create .venv with the CPU stack (torch, fbgemm-gpu-cpu, torchrec) and balancer
# in editable mode with its dev and bench extras. Idempotent: re-running only
# installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-cpu.txt
.venv/bin/python -m pip install -q -e '.[dev,bench]'
.venv/bin/python -m pip check
.venv/bin/python -c "import torch, fbgemm_gpu, torchrec, balancer; print('balancer ready: torch', torch.__version__, '| torchrec', torchrec.__version__)"
