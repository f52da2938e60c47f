#!/usr/bin/env bash
# Every GPU check in one call, for a machine with an NVIDIA GPU, CuPy and torch with CUDA:
#   1. build collectives._native in place (the world-of-one communicator and the launcher use it)
#   2. the GPU tests: all of tests/gpu (the GPU-free ones run too), NCCL on the real device
#   3. a torch CNN trained on CUDA with DistributedOptimizer (tests/gpu/_gpu_cnn.py)
#   4. benchmarks/gpu.py: our NCCL path vs torch.distributed NCCL, ResNet-50 gradient set
# Usage, from anywhere:  bash benchmarks/gpu_check.sh     (NP=2 for two GPUs)
# Logs and gpu.json go to $OUT when it is set (the device tool's folder), else benchmarks/results/.
# Exit status: 0 only if every step passed.  About 3-6 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
NP="${NP:-1}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

{
  nvidia-smi -L
  "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| GPUs", torch.cuda.device_count())
try:
    import cupy
    from collectives.backends.nccl import available
    print("cupy", cupy.__version__, "|", available())
except Exception as exc:
    print("cupy/nccl:", type(exc).__name__, exc)
EOF
} 2>&1 | tee "$OUT/gpu_env.log"

echo "== 1. build collectives._native"
if "$PY" setup.py build_ext --inplace -q >"$OUT/gpu_build.log" 2>&1; then
  echo "built"; build=0
else
  tail -20 "$OUT/gpu_build.log"; echo "build failed: tests needing the native backend will fail"; build=1
fi

echo "== 2. GPU tests"
timeout 330 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}

echo "== 3. CNN on CUDA with DistributedOptimizer (np=$NP)"
if [ "$NP" -gt 1 ]; then
  timeout 240 "$PY" -m collectives.launch -n "$NP" tests/gpu/_gpu_cnn.py 40 2>&1 | tee "$OUT/gpu_cnn.log"
else
  timeout 240 "$PY" tests/gpu/_gpu_cnn.py 40 2>&1 | tee "$OUT/gpu_cnn.log"
fi
cnn=${PIPESTATUS[0]}

echo "== 4. benchmarks/gpu.py (np=$NP)"
timeout 330 "$PY" benchmarks/gpu.py --np "$NP" --json "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_bench.log"
bench=${PIPESTATUS[0]}

echo "gpu_check: build=$build tests=$tests cnn=$cnn bench=$bench" | tee "$OUT/gpu_summary.log"
[ "$build$tests$cnn$bench" = "0000" ]
