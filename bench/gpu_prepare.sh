#!/usr/bin/env bash
# Run this on a machine WITH network access, before taking the repository to a
# GPU machine that has torch + CUDA but no network (docs/gpu.md).
#
#   bash bench/gpu_prepare.sh
#
# Downloads, into .gpu-wheels/ (git-ignored; carry it with the working tree),
# the wheels that the kernel, areal-fsdp and areal-megatron import at run time
# and that such a machine lacks (it has torch, transformers, safetensors,
# pluggy, PyYAML, aiohttp, cloudpickle, numpy, pytest: the list in docs/gpu.md).
# bench/gpu_check.sh installs them there with pip --no-index. Only wheels for
# the GPU machine's Python (GPU_PYTHON_VERSION, default 3.12) on x86-64 Linux,
# without dependencies: the list below is the whole set.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${GPU_CHECK_WHEELS:-.gpu-wheels}
PYVER=${GPU_PYTHON_VERSION:-3.12}
PY=${PYTHON:-python3}
LIMIT_MB=48 # the whole working tree that travels with the run has a 64 MiB limit

# The versions the project's CPU environment tests with (pins where the
# project pins: megatron-core 0.16.1, the release areal-megatron was checked against).
WHEELS=(
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    structlog==26.1.0
    packaging==26.4
    megatron-core==0.16.1
)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DEST" "${WHEELS[@]}"

n=$(ls "$DEST"/*.whl | wc -l)
if [ "$n" -ne "${#WHEELS[@]}" ]; then
    echo "gpu_prepare: expected ${#WHEELS[@]} wheels in $DEST, found $n:" >&2
    ls "$DEST" >&2
    exit 1
fi
kb=$(du -sk "$DEST" | cut -f1)
if [ "$kb" -gt $((LIMIT_MB * 1024)) ]; then
    echo "gpu_prepare: $DEST holds ${kb} KiB, over the ${LIMIT_MB} MiB this run may carry" >&2
    exit 1
fi
ls -1 "$DEST"
echo "gpu_prepare: ${n} wheels, ${kb} KiB in $DEST (Python ${PYVER}, x86-64 Linux); now run bash bench/gpu_check.sh on the GPU machine"
