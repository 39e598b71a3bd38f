#!/usr/bin/env bash
# The GPU check (README "The GPU check"): the same command every time a GPU is lent, until the table is full.
#   bash scripts/gpu_check.sh [--budget SECONDS] [--out DIR] [other python -m jagg_core.gpu_check options]
# Reads what earlier checks measured (docs/gpu/*.json), runs first what was never measured or last failed, each
# step in its own process under its own cap, and writes DIR/STEP.json, DIR/STEP.log and DIR/gpu_check.md
# (default DIR: docs/gpu). A lent machine returns at most 8 files: there, give --out /tmp/gpu-check --archive
# "$OUT/gpu_check.tar.gz" (every file of DIR, rewritten after each step) and unpack it into docs/gpu/ afterwards.
# Needs a Python with the CUDA build of torch and the project's requirements. On an offline GPU machine whose
# Python already has torch, the other wheels can travel in .whl/ (made by scripts/gpu_wheels.sh elsewhere):
# they are installed into a private folder first when the Python lacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if ! "$python" -c "import diffusers, peft, pydantic, torchao, bitsandbytes, imageio_ffmpeg" 2> /dev/null \
    && ls .whl/*.whl > /dev/null 2>&1; then
  site="${TMPDIR:-/tmp}/jagg-gpu-site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec "$python" -m jagg_core.gpu_check --ledger docs/gpu "$@"
