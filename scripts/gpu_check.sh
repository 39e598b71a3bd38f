#!/usr/bin/env bash
# One-command GPU check (README "Real model sizes"): about 8 minutes on one 80-140 GB GPU.
#   bash scripts/gpu_check.sh [OUT_DIR]      writes OUT_DIR/gpu_check.json, gpu_check.md and gpu_check.log
# Needs a Python with the CUDA build of torch and the project's requirements. On an offline GPU machine whose
# Python already has torch, the other wheels can travel in .whl/ (made by scripts/gpu_wheels.sh elsewhere):
# they are installed into a private folder first when the Python lacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_check}}"
python="${PYTHON:-python3}"
if ! "$python" -c "import diffusers, peft, pydantic, torchao, bitsandbytes" 2> /dev/null && ls .whl/*.whl > /dev/null 2>&1; then
  site="${TMPDIR:-/tmp}/jagg-gpu-site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec "$python" -m jagg_core.gpu_check --out "$out" "${@:2}"
