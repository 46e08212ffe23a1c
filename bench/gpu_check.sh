#!/usr/bin/env bash
# The CUDA backend's checks on a machine with an NVIDIA GPU, in one command:
#
#     bash bench/gpu_check.sh OUTDIR
#
# 1. installs the package with its CUDA and test extras (PyCUDA builds from source against the
#    local toolkit; the CUDA kernels are compiled by nvcc), timing the install;
# 2. runs tests/test_cuda.py (every op against the CPU backend, dequantization bit for bit, greedy
#    text of CUDA0 and of an rpc_server --device CUDA0 split, GPU trace spans);
# 3. compares the CUDA backend's logits with the CPU backend's on the medium test model;
# 4. times decode at batch 1/8/32 on the medium model against the memory-bandwidth roofline;
# 5. traces one generate run split between an rpc_server --device CUDA0 and the local CPU.
#
# Everything lands under OUTDIR (one log per step, JSON results, the trace files, summary.txt).
# Set GPU_CHECK_SKIP_INSTALL=1 to reuse an existing install, GPU_CHECK_PIP_ARGS for extra pip
# arguments (offline: "--no-index --find-links DIR --no-build-isolation", DIR holding what
# `pip download pycuda` fetched), GPU_CHECK_BANDWIDTH (bytes/s) for a GPU other than an H200
# (4.8e12), GPU_CHECK_WTYPE for another weight type of the model (f16).
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash bench/gpu_check.sh OUTDIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
BANDWIDTH=${GPU_CHECK_BANDWIDTH:-4.8e12}
WTYPE=${GPU_CHECK_WTYPE:-f16}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0

note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME COMMAND...: runs it with its output in OUT/NAME.log, notes the outcome
    local name=$1
    shift
    local t0=$SECONDS rc
    "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        note "ok   $name ($((SECONDS - t0)) s)"
    else
        note "FAIL $name ($((SECONDS - t0)) s, exit $rc): see $OUT/$name.log"
        status=1
    fi
}

note "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true; } 2>&1 | tee -a "$SUMMARY"
{ command -v nvcc && nvcc --version | tail -n 2; } 2>&1 | tee -a "$SUMMARY"

if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != "1" ]; then
    # shellcheck disable=SC2086 # GPU_CHECK_PIP_ARGS is a list of words
    step install "$PY" -m pip install ${GPU_CHECK_PIP_ARGS:-} -e ".[cuda,test]"
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
from pyllama.backend import cuda
try:
    b = cuda.open_backend("CUDA0")
    info = b.device_info()
    print(f"CUDA0: {info.description}, {info.free / 2**30:.1f} of {info.total / 2**30:.1f} GiB free")
    b.close()
except Exception as exc:
    print(f"CUDA0 unavailable: {exc}")
EOF

step tests "$PY" -m pytest -v -rs tests/test_cuda.py --junitxml="$OUT/test_cuda.xml"
grep -E "passed|failed|skipped|error" "$OUT/tests.log" | tail -n 1 | tee -a "$SUMMARY"
step compare "$PY" bench/cuda_bench.py compare --preset medium --wtype "$WTYPE" --json "$OUT/compare.json"
step decode "$PY" bench/cuda_bench.py decode --preset medium --wtype "$WTYPE" --batches 1,8,32 \
    --bandwidth "$BANDWIDTH" --json "$OUT/decode.json"
grep -E "^#|\|" "$OUT/decode.log" | tee -a "$SUMMARY"
step split "$PY" bench/cuda_bench.py split --preset medium --wtype "$WTYPE" --out "$OUT/split" --json "$OUT/split.json"
note "# results in $OUT"
exit $status
