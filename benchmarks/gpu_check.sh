#!/usr/bin/env bash
# Every GPU check in one call, for a machine with an NVIDIA GPU, CuPy and torch with CUDA:
#   1. build collectives._native in place (the communicator and the launcher use it)
#   2. the GPU tests: all of tests/gpu (the GPU-free ones run too), NCCL on the real device;
#      with one GPU, the two-rank tests put both ranks on it as two NCCL hosts (_shared_gpu.py)
#   3. benchmarks/gpu_profile.py: where the time of one hvd op on CUDA goes (cProfile)
#   4. benchmarks/gpu.py: our NCCL path vs torch.distributed NCCL, ResNet-50 gradient set,
#      on one rank, then on two ranks (one GPU each, or sharing the one GPU over sockets)
# Usage, from anywhere:  bash benchmarks/gpu_check.sh
# Logs and JSON go to $OUT when it is set (the device tool's folder), else benchmarks/results/.
# Each step is bounded (timeout); exit status 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# CuPy compiles its kernels on first use; a cache carried from an earlier run saves that.
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$PWD/.cupy_cache}"
mkdir -p "$CUPY_CACHE_DIR"
[ -f .gpu_carry/cupy_cache.tgz ] && tar -xzf .gpu_carry/cupy_cache.tgz -C "$CUPY_CACHE_DIR"
# CuPy finds NCCL where the framework's wheel put it, if the loader does not already.
nccl_dir=$("$PY" -c "import glob, os, site
libs = [p for d in site.getsitepackages() for p in glob.glob(os.path.join(d, 'nvidia', '**', 'libnccl.so*'), recursive=True)]
print(os.path.dirname(libs[0]) if libs else '')" 2>/dev/null)
[ -n "$nccl_dir" ] && export LD_LIBRARY_PATH="$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

{
  nvidia-smi -L
  "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| GPUs", torch.cuda.device_count(), "| torch NCCL", torch.cuda.nccl.version())
try:
    import cupy
    from collectives.backends.nccl import available
    print("cupy", cupy.__version__, "|", available())
except Exception as exc:
    print("cupy/nccl:", type(exc).__name__, exc)
EOF
} 2>&1 | tee "$OUT/gpu_env.log"

step() {  # step NAME SECONDS CMD...: run bounded, log to $OUT/gpu_NAME.log, remember the status
  local name=$1 secs=$2; shift 2
  echo "== $name ($(date +%T))"
  timeout "$secs" "$@" 2>&1 | tee "$OUT/gpu_$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  status="$status $name=$rc"
}
status=""

echo "== build ($(date +%T))"
if HVS_BUILD_JOBS=8 "$PY" setup.py build_ext --inplace -q >"$OUT/gpu_build.log" 2>&1; then
  echo "built"; status="build=0"
else
  tail -20 "$OUT/gpu_build.log"; status="build=1"
fi

step tests "${TESTS_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -rs --timeout 150 tests/gpu
step profile "${PROFILE_S:-60}" "$PY" benchmarks/gpu_profile.py
step bench1 "${BENCH_S:-90}" "$PY" benchmarks/gpu.py --np 1 --json benchmarks/results/gpu.json
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  step bench2 "${BENCH_S:-90}" "$PY" benchmarks/gpu.py --np 2 --json benchmarks/results/gpu_np2.json
else
  # over sockets: fewer reps, up to 64 MiB; each part prints as it finishes
  step bench2 "${BENCH2_S:-150}" "$PY" -m collectives.launch -n 2 --hosts gpu-host-0,gpu-host-1 \
    tests/gpu/_shared_gpu.py benchmarks/gpu.py --np 2 --reps 3 --max $((64 << 20)) \
    --json benchmarks/results/gpu_np2.json
fi

tar -czf "$OUT/cupy_cache.tgz" -C "$CUPY_CACHE_DIR" . 2>/dev/null
echo "gpu_check:$status" | tee "$OUT/gpu_summary.log"
case "$status" in *=[1-9]*) exit 1 ;; esac
