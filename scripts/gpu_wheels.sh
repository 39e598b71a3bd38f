#!/usr/bin/env bash
# Wheels for running the GPU check on an offline GPU machine that already has torch (CUDA) and the common
# scientific packages: bash scripts/gpu_wheels.sh [PYTHON_VERSION [CUDA_MAJOR]] fills .whl/ (default Python 3.12,
# CUDA 13, x86-64 Linux) with the requirements such a machine tends to lack (about 48 MB); scripts/gpu_check.sh
# installs them from there. The repo and .whl/ must fit what a lent GPU machine's call carries (64 MiB), so:
# - bitsandbytes ships one library per CUDA and ROCm release (43 MB in all); its wheel is rewritten with the
#   libraries of CUDA_MAJOR alone (scripts/trim_wheel.py; it loads torch's: libbitsandbytes_cuda130.so for cu130);
# - imageio-ffmpeg (its own ffmpeg, for the MP4s of video runs) is 0.5.1, 27 MB, the smallest release the
#   requirements accept (0.8 is 68 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
cuda_major="${2:-13}"
packages=(diffusers==0.42.1 peft==0.21.2 torchao==0.18.0 "bitsandbytes>=0.45" imageio-ffmpeg==0.5.1
          pydantic pydantic-core annotated-types typing-inspection)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux2010_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  "${platforms[@]}" -d .whl "${packages[@]}"
python3 scripts/trim_wheel.py "$cuda_major" .whl/bitsandbytes-*.whl
wheels=$(cat .whl/*.whl | wc -c)
tracked=$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat | wc -c)
limit=$((64 * 1024 * 1024))
echo "$((wheels / 1000000)) MB of wheels in .whl/ + $((tracked / 1000000)) MB of the working tree: \
$(((wheels + tracked) * 100 / limit))% of the 64 MiB a device call carries"
if ((wheels + tracked > limit)); then
  echo "over the limit: the call would be refused; carry fewer wheels" >&2
  exit 1
fi
