#!/usr/bin/env bash
# The GPU run, from the repo root (bench/gpu_run.py says what each step does and what comes back):
#
#     bench/gpu_run.sh --fetch-wheels          # here, once: bench/gpu_wheels.txt into bench/wheels/
#     bench/gpu_run.sh --preflight             # here: the device steps' imports with only what the GPU
#                                              #   machine has, and the wheels install for its Python
#     bench/gpu_run.sh OUT_DIR --cpu-dry-run   # here: every step on the CPU, small sizes, imports restricted
#     bench/gpu_run.sh OUT_DIR                 # on the GPU machine: about 7 minutes
#     bench/gpu_run.sh OUT_DIR --only smoke,bench --deadline-s 300   # some steps (bench/gpu_run.py --help)
#
# The GPU machine has no package registry. Its image (bench/gpu_image.txt) has Python 3.12, jax 0.11.2 with
# its CUDA 13 plugin, triton 3.6, torch, pytest, nvidia-ml-py, psutil; what bankml needs beyond that
# (bench/gpu_wheels.txt: gguf, jax-triton) is fetched here into bench/wheels/ (git ignores it; the device
# tool carries it: carry=["bench/wheels"]) and installed there with pip --no-index into $SITE, only for
# the modules the image lacks. OUT_DIR gets run.json and logs.tar.gz, rewritten as the steps go.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY=${PYTHON:-python3}  # the image's Python with jax; PYTHON=... names another
WHEEL_TAGS=(--python-version 3.12 --implementation cp --platform manylinux2014_x86_64
            --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p bench/wheels
    exec "$PY" -m pip download -q --no-deps --only-binary=:all: "${WHEEL_TAGS[@]}" -d bench/wheels -r bench/gpu_wheels.txt
fi

wheels_install_check() {  # every carried wheel installs for the GPU image's Python, into a scratch target
    local scratch rc
    scratch=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --only-binary=:all: "${WHEEL_TAGS[@]}" --target "$scratch" bench/wheels/*.whl
    rc=$?
    rm -rf "$scratch"
    return $rc
}

PREFLIGHT=0
if [ "${1:-}" = "--preflight" ]; then
    PREFLIGHT=1
    compgen -G "bench/wheels/*.whl" > /dev/null || { echo "no wheels in bench/wheels/: bench/gpu_run.sh --fetch-wheels" >&2; exit 1; }
    wheels_install_check || { echo "the carried wheels do not install for CPython 3.12 manylinux x86_64" >&2; exit 1; }
    SITE=$(mktemp -d)  # the wheels this Python lacks go here, as on the device
else
    OUT=${1:?usage: bench/gpu_run.sh OUT_DIR [--cpu-dry-run] | --fetch-wheels | --preflight}
    SITE=${BANKML_SITE:-/tmp/bankml-site}
fi
DRY=0
for arg in "${@:2}"; do [ "$arg" = "--cpu-dry-run" ] && DRY=1; done

# the carried wheels: only those whose module the image cannot find (found, not imported: jax_triton's
# import fails on a CPU jaxlib though it is installed)
module_of() { basename "$1" | sed 's/-.*//'; }  # gguf-0.19.0-... -> gguf, jax_triton-0.3.1-... -> jax_triton
need=()
for whl in bench/wheels/*.whl; do
    [ -e "$whl" ] || { echo "[gpu_run] no wheels in bench/wheels/: bench/gpu_run.sh --fetch-wheels, then carry them" >&2; break; }
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$(module_of "$whl")') is None)" \
        2> /dev/null || need+=("$whl")
done
if [ ${#need[@]} -gt 0 ]; then
    mkdir -p "$SITE"
    if ! "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "${need[@]}" >&2; then
        echo "[gpu_run] pip failed: unzipping the wheels instead" >&2
        for whl in "${need[@]}"; do "$PY" -m zipfile -e "$whl" "$SITE"; done
    fi
fi
export BANKML_WHEELS_INSTALLED="${need[*]:-}"
if [ $PREFLIGHT = 1 ]; then
    PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" bench/gpu_preflight.py
    rc=$?
    rm -rf "$SITE"
    exit $rc
fi
if [ $DRY = 1 ]; then
    # the dry run: every Python process imports only what the GPU machine has (bench/gpu_preflight.py)
    export BANKML_GPU_RESTRICT=1
    export PYTHONPATH="$PWD/bench/preflight_site:$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" bench/gpu_run.py "$OUT" "${@:2}"  # --cpu-dry-run, --only STEPS, --deadline-s S
