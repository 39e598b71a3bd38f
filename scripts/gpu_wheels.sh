#!/usr/bin/env bash
# Wheels for running the GPU check on an offline GPU machine that already has torch (CUDA) and the common
# scientific packages: bash scripts/gpu_wheels.sh [PYTHON_VERSION] fills .whl/ (default Python 3.12, x86-64
# Linux) with the requirements such a machine tends to lack (about 56 MB); scripts/gpu_check.sh installs them
# from there.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
packages=(diffusers==0.42.1 peft==0.21.2 torchao==0.18.0 "bitsandbytes>=0.45"
          pydantic pydantic-core annotated-types typing-inspection)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  "${platforms[@]}" -d .whl "${packages[@]}"
du -sh .whl
