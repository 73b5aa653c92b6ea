#!/usr/bin/env bash
# The GPU check, one command on a machine with a GPU: make fastckpt importable there with an OpenCL GPU platform,
# run the device tests on every device present, run the GPU benchmark cases (the device suite's 4 GiB and 1000 x
# 4 KiB cases, the model suite, the cold case: tools/gpu-cold.py, loads of a file dropped from the page cache, in a
# new process per run, against the plain reads of it and torch's safetensors loader, and the staging sweep:
# tools/gpu-sweep.py, the staged load's buffers, chunk and fill threads on the device), and print one table
# (exactness, GB/s, share of the pinned bound measured on that GPU) with every target met or missed.
#
#   tools/gpu-check.sh [--quick] [WHEELS_DIR]
#       --quick      the small sizes of the benchmark cases (seconds), for trying the script itself
#       WHEELS_DIR   wheels to install from, for a machine with no package index (see --make-wheels)
#   tools/gpu-check.sh --make-wheels WHEELS_DIR
#       on a machine with a package index and the GPU machine's Python version (python3.12 from pyenv, say:
#       PYTHON=python3.12): fastckpt's wheel and its runtime dependencies' wheels into WHEELS_DIR (about 4 MB
#       without pocl, whose 58 MB wheel a GPU machine does not need)
#
# PYTHON picks the interpreter (default python3); GPU_COLD_RUNS and GPU_COLD_MIB the cold case's runs
# per row (default 5) and file size (default 4096); GPU_SWEEP_ARGS more options for tools/gpu-sweep.py. To try the script where there is no GPU: GPU_CHECK_KIND=cpu
# (benchmarks on the CPU device) and GPU_CHECK_TESTS="tests/test_progress.py" (the tests to run instead of all). What it installs goes under build/gpu-check/ (PYTHONPATH), never
# into the interpreter's own site-packages. Where no ICD file names the NVIDIA driver's OpenCL library, one is
# written there and OCL_ICD_VENDORS points at it (pyopencl's ICD loader honours it). Logs: build/gpu-check/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
RUNTIME="numpy ml_dtypes pyopencl pytools platformdirs siphash24 typing_extensions crc32c cramjam zlib-ng blake3 tqdm"
TESTING="pytest hypothesis safetensors"

if [ "${1:-}" = "--make-wheels" ]; then
    dir="${2:?--make-wheels needs a directory}"
    mkdir -p "$dir"
    "$PY" -m pip wheel -q --no-deps . -w "$dir"
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --only-binary=:all: --no-deps -d "$dir" $RUNTIME $TESTING iniconfig pluggy packaging \
        sortedcontainers attrs
    ls -la "$dir"
    exit 0
fi

QUICK=""
WHEELS=""
KIND="${GPU_CHECK_KIND:-gpu}"
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK="--quick" ;;
        *) WHEELS="$arg" ;;
    esac
done
OUT="$PWD/build/gpu-check"
SITE="$OUT/site"
mkdir -p "$OUT"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

echo "== python: $("$PY" --version)"
if ! "$PY" -c "import numpy, ml_dtypes, pyopencl, crc32c, cramjam, zlib_ng, blake3, tqdm, pytest, hypothesis" \
        >/dev/null 2>&1; then
    if [ -n "$WHEELS" ]; then
        # fastckpt's own wheel is not installed: this checkout is what runs (its compiled extensions below).
        # shellcheck disable=SC2046
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE" $(ls "$WHEELS"/*.whl | grep -v "/fastckpt-")
    else
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --target "$SITE" $RUNTIME $TESTING
    fi
fi

# fastckpt's compiled extensions for this interpreter: built in place where Cython and a compiler are there, else
# taken from fastckpt's wheel (its .so files next to the sources; their names carry the Python version).
if ! "$PY" -c "import fastckpt._native.mapped, fastckpt._native.tensorindex" >/dev/null 2>&1; then
    if ! "$PY" setup.py -q build_ext --inplace -j "$(nproc)" >"$OUT/build.log" 2>&1; then
        wheel="$(ls "${WHEELS:-/nonexistent}"/fastckpt-*.whl 2>/dev/null | head -1 || true)"
        [ -n "$wheel" ] || { echo "cannot build fastckpt's extensions (build/gpu-check/build.log) and no fastckpt" \
                                  "wheel was given; make one with --make-wheels" >&2; exit 1; }
        "$PY" - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("fastckpt/_native/") and name.endswith(".so"):
            z.extract(name, ".")
PY
    fi
fi

# An OpenCL GPU platform: where none is found, an ICD file for the vendor library that is there.
has_gpu() {
    "$PY" -c "import sys, pyopencl as cl
sys.exit(0 if any(d.type & cl.device_type.GPU for p in cl.get_platforms() for d in p.get_devices()) else 1)" \
        >/dev/null 2>&1
}
if [ "$KIND" = gpu ] && ! has_gpu; then
    for lib in /usr/local/nvidia/lib64/libnvidia-opencl.so.1 /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so.1 \
               /usr/lib64/libnvidia-opencl.so.1 /opt/rocm/lib/libamdocl64.so /usr/lib/x86_64-linux-gnu/libamdocl64.so; do
        if [ -e "$lib" ]; then
            mkdir -p "$OUT/icd"
            echo "$lib" > "$OUT/icd/$(basename "$lib" | cut -d. -f1).icd"
        fi
    done
    export OCL_ICD_VENDORS="$OUT/icd"
    has_gpu || { echo "no OpenCL GPU found (looked for the NVIDIA and AMD OpenCL libraries too)" >&2; exit 1; }
fi
"$PY" -c "
from fastckpt.device import default
d = default('$KIND')
print('== device:', d.name, '| driver', d.device.driver_version, '|', d.device.version.strip(), '|',
      'shares host memory' if d.host_unified_memory else 'discrete')" | tee "$OUT/device.txt"

echo "== device tests (pytest -m 'device and not slow', every device kind present)"
set +e
# shellcheck disable=SC2086
"$PY" -m pytest -m "device and not slow" -q -p no:cacheprovider -rfE ${GPU_CHECK_TESTS:-} >"$OUT/tests.log" 2>&1
tests_rc=$?
set -e
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 || true
tests_line="$(tail -1 "$OUT/tests.log")"
echo "$tests_line"

echo "== benchmarks (device suite, cases d and b, on the GPU)"
# shellcheck disable=SC2086
"$PY" -m fastckpt bench --suite device --device "$KIND" --case d --case b --repeat 5 $QUICK | tee "$OUT/bench.md"

echo "== benchmarks (model suite: the 64 MiB MLP and 400 small layers, on the default device)"
if [ -z "$QUICK" ]; then
    FASTCKPT_DEVICE="$KIND" "$PY" -m fastckpt bench --suite model --repeats 5 | tee "$OUT/model.md"
else
    FASTCKPT_DEVICE="$KIND" "$PY" -m fastckpt bench --suite model --repeats 1 | tee "$OUT/model.md"
fi

echo "== cold (tools/gpu-cold.py: the file dropped from the page cache, a new process per run, staged load)"
# shellcheck disable=SC2086
PYTHONPATH="$PWD:$PYTHONPATH" "$PY" tools/gpu-cold.py --kind "$KIND" --runs "${GPU_COLD_RUNS:-5}" \
    --mib "${GPU_COLD_MIB:-4096}" $QUICK \
    | tee "$OUT/cold.md"

echo "== staging sweep (tools/gpu-sweep.py: buffers x chunk x fill threads of the staged load, warm, on the device)"
# shellcheck disable=SC2086
PYTHONPATH="$PWD:$PYTHONPATH" "$PY" tools/gpu-sweep.py --kind "$KIND" ${GPU_SWEEP_ARGS:-} $QUICK | tee "$OUT/sweep.md"

echo
echo "== summary"
cat "$OUT/device.txt"
echo "device tests: $tests_line"
awk '/^### \(d\)/{on=1} on&&/^$/&&seen{exit} on{print; if (/^\|/) seen=1}' "$OUT/bench.md"
echo "cold: $(head -1 "$OUT/cold.md" | sed 's/^### cold: //')"
grep -E "^\|" "$OUT/cold.md" || true
grep -E "^- (best|load_file)" "$OUT/sweep.md" || true
grep -hE "^- (met|MISSED)" "$OUT/bench.md" "$OUT/model.md" "$OUT/cold.md" || true
exit "$tests_rc"
