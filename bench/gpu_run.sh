#!/usr/bin/env bash
# One command for a lent GPU machine with no package registry, from the repo root:
#
#     bench/gpu_run.sh OUT_DIR                 # on the GPU machine, well under 8 minutes
#     bench/gpu_run.sh OUT_DIR --cpu-dry-run   # here: every step that runs without a GPU, small sizes
#     bench/gpu_run.sh --fetch-wheels          # here, once: bench/gpu_wheels.txt into bench/wheels/
#
# The image has Python 3.12, jax 0.11.2 (cuda13 plugin), triton 3.6 and torch, but no gguf, sanic or
# openai. What bankml needs beyond that (bench/gpu_wheels.txt) is fetched here with --fetch-wheels into
# bench/wheels/ (2.8 MB, pure Python but PyYAML's cp312 x86_64 wheel; git ignores it, so carry it to the
# machine with the tree: the device tool's carry=["bench/wheels"]) and installed with `pip install --no-index --no-deps --target` into $SITE, only
# for the modules the image does not have. The script exits 1 when any step failed. Then, each step time-boxed and its JSON written to OUT_DIR:
#   env.json          python, jax and its devices, triton, nvidia-smi, what was installed
#   gpu_check.json    python -m bankml.cli gpu-check --json           (exit code in steps.json)
#   gpu_tests.json    pytest -m gpu tests/test_gpu_kernels.py, each check's numbers (+ gpu_tests.xml)
#   synth.json        bench/synth_gguf.py llama3-8b into $MODEL_DIR (the machine's disk; skipped when there),
#                     beside gpu-check and the tests
#   bench.json        bench/gpu.py on it (and SmolLM2 / gemma3 if their files are there)
#   steps.json        each step's exit code and seconds
# A step's stderr goes to OUT_DIR/<step>.log. A step that fails does not stop the next one.
set -u

if [ "${1:-}" = "--fetch-wheels" ]; then
    cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
    exec "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 -d bench/wheels -r bench/gpu_wheels.txt
fi
OUT=${1:?usage: bench/gpu_run.sh OUT_DIR [--cpu-dry-run] | --fetch-wheels}
DRY=0
[ "${2:-}" = "--cpu-dry-run" ] && DRY=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}  # the image's Python with jax; PYTHON=... names another
SITE=${BANKML_SITE:-/tmp/bankml-site}
MODEL_DIR=${BANKML_GPU_MODELS:-/tmp/bankml-gpu-models}  # 4.9 GB: never under OUT_DIR (it comes back)
: > "$OUT/steps.tsv"

limit() { if [ $DRY = 1 ]; then echo $(( $1 * 4 )); else echo "$1"; fi; }  # this 2-core box is slower
say() { echo "[gpu_run $(date -u +%H:%M:%S)] $*" >&2; }

# step NAME SECONDS STDOUT CMD...: run CMD under `timeout`, its stdout to STDOUT, its stderr to NAME.log;
# record its exit code and seconds
step() {
    local name=$1 limit=$2 stdout=$3 t0 rc
    shift 3
    say "$name (at most ${limit} s): $*"
    t0=$(date +%s%N)
    timeout -k 5 "$limit" "$@" > "$stdout" 2> "$OUT/$name.log"
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( ($(date +%s%N) - t0) / 1000000 ))" >> "$OUT/steps.tsv"
    say "$name: exit $rc"
}

# --- the carried wheels: only what the image cannot import --------------------------------------------
module_of() {  # a wheel's file name -> the module it provides
    case $(basename "$1") in
        absl_py-*) echo absl ;; pyyaml-*|PyYAML-*) echo yaml ;; *) basename "$1" | sed 's/-.*//' ;;
    esac
}
need=()
if ! compgen -G "bench/wheels/*.whl" > /dev/null; then
    say "no wheels in bench/wheels/: run bench/gpu_run.sh --fetch-wheels where a registry is, and carry them"
fi
for whl in bench/wheels/*.whl; do
    # found, not imported: jax_triton's import fails on a CPU jaxlib though it is installed
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$(module_of "$whl")') is None)" \
        2> /dev/null || need+=("$whl")
done
if [ $DRY = 1 ]; then
    # here every module is installed already: prove the carried set installs for the GPU image's Python
    # (3.12, manylinux x86_64) into a scratch target that is never put on the path
    step wheels_dry_run 120 /dev/null "$PY" -m pip install -q --no-index --no-deps --only-binary=:all: \
        --python-version 3.12 --platform manylinux2014_x86_64 --target "$OUT/.wheels-check" bench/wheels/*.whl
    rm -rf "$OUT/.wheels-check"
fi
if [ ${#need[@]} -gt 0 ]; then
    mkdir -p "$SITE"
    if ! "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${need[@]}" 2> "$OUT/wheels.log"; then
        say "pip failed (see wheels.log): unzipping the wheels instead"
        for whl in "${need[@]}"; do "$PY" -m zipfile -e "$whl" "$SITE"; done
    fi
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - "${need[@]}" > "$OUT/env.json" 2> "$OUT/env.log" << 'EOF'
import importlib, json, platform, shutil, subprocess, sys
env = {"python": platform.python_version(), "machine": platform.machine(), "installed_here": sys.argv[1:]}
for name in ("jax", "jaxlib", "triton", "jax_triton", "gguf", "numpy", "torch", "pytest", "yaml"):
    try:
        env[name] = getattr(importlib.import_module(name), "__version__", "present")
    except Exception as e:
        env[name] = f"absent: {type(e).__name__}: {e}"
try:
    import jax
    env["backend"] = jax.default_backend()
    env["devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
except Exception as e:
    env["backend"] = f"failed: {type(e).__name__}: {e}"
if shutil.which("nvidia-smi"):
    q = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.mem", "--format=csv,noheader"]
    env["nvidia_smi"] = subprocess.run(q, capture_output=True, text=True).stdout.strip()
print(json.dumps(env, indent=1))
EOF
say "env: $(tr -d '\n' < "$OUT/env.json" | head -c 400)"

# --- the checks and the bench, time-boxed: on the GPU machine 90 + 120 + 210 s at most ---------------
# The synthetic model (4.9 GB; the dry run's is `tiny`) is written beside the checks, which leave the
# disk alone; kept in $MODEL_DIR, where a second run finds it.
if [ $DRY = 1 ]; then shape=tiny; else shape=llama3-8b; fi
SYNTH=$MODEL_DIR/synthetic-$shape.gguf  # the name bench/gpu.py looks for
synth_pid=
if [ ! -f "$SYNTH.FORK.json" ]; then
    mkdir -p "$MODEL_DIR"
    step synth "$(limit 90)" "$OUT/synth.json" "$PY" bench/synth_gguf.py "$shape" "$SYNTH" &
    synth_pid=$!
fi

step gpu_check "$(limit 90)" "$OUT/gpu_check.json" "$PY" -m bankml.cli gpu-check --json

# tests/conftest.py turns Triton's interpreter on unless told: the gpu tests compile for the device.
# The dry run runs them on the CPU, kernels interpreted (tests/test_gpu_kernels.py says how).
if [ $DRY = 1 ]; then test_env=(BANKML_GPU_TESTS_ON_CPU=1 TRITON_INTERPRET=1); else test_env=(TRITON_INTERPRET=0); fi
step gpu_tests "$(limit 120)" "$OUT/gpu_tests.txt" env "${test_env[@]}" BANKML_GPU_REPORT="$OUT/gpu_tests.json" \
    "$PY" -m pytest -q -o addopts=-ra -m gpu tests/test_gpu_kernels.py -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml"

[ -n "$synth_pid" ] && wait "$synth_pid"
if [ $DRY = 1 ]; then
    step bench 600 "$OUT/bench.stdout" "$PY" bench/gpu.py --quick --no-llama --out "$OUT/bench.json" \
        --model-dir "$MODEL_DIR"
else
    step bench 210 "$OUT/bench.stdout" "$PY" bench/gpu.py --out "$OUT/bench.json" --budget-s 150 \
        --model-dir "$MODEL_DIR"
fi

# steps.json; this script's own exit: 1 when any step's was not 0
"$PY" - "$OUT/steps.tsv" > "$OUT/steps.json" << 'EOF'
import json, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
steps = [{"step": n, "exit": int(rc), "seconds": round(int(ms) / 1e3, 1)} for n, rc, ms in rows]
print(json.dumps(steps, indent=1))
sys.exit(any(s["exit"] for s in steps))
EOF
rc=$?
rm -f "$OUT/steps.tsv"
cat "$OUT/steps.json"
exit $rc
