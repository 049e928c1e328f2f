#!/usr/bin/env bash
# One GPU session: build the CUDA kernels, run the GPU tests, then the GPU benchmarks, each under its own time
# limit so that one slow step cannot eat the others. Logs go to $OUT (or ./gpu_logs) as gpu_*.log.
#   bash tests/gpu/run_session.sh            # everything (about 8 minutes on an H200)
#   STEPS="build tests" bash tests/gpu/run_session.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-gpu_logs}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
steps=${STEPS:-"build tests calib_parity bench_fake_quant bench_real_int8 bench_cuda"}

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  case " $steps " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$out/gpu_$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
  tail -n 40 "$out/gpu_$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"; } 2>&1
step build 200 python3 -m modelopt_lite precompile
step tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_quant_modules_cuda.py
step calib_parity 40 python3 bench/calib_cuda_parity.py
step bench_fake_quant 120 python3 bench/bench_fake_quant.py --device cuda --dtype fp32
step bench_real_int8 60 python3 bench/bench_real_int8.py --device cuda
step bench_cuda 100 python3 bench/bench_cuda.py --no-peers
