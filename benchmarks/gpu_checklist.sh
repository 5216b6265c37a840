#!/usr/bin/env bash
# The GPU checklist in one command, for a lent GPU machine (CI has none):
#   bash benchmarks/gpu_checklist.sh [OUT_DIR]
# Runs the CUDA tests behind their skip marker: stage processes sharing one GPU (gloo, through
# host memory) against the single-device references, host swap on its CUDA stream, 16-mixed
# (real GradScaler) and bf16-mixed against Lightning on one GPU, the memory monitor's CUDA
# peaks, and block timing on CUDA. Uses the machine's own torch and Lightning; the package is
# taken from this checkout (PYTHONPATH). The figures are the lines starting with "CUDA"; record
# them with the device in benchmarks/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/gpu_env.txt"
python3 -m pytest tests/ranks/test_cuda.py \
  "tests/unit/test_measure.py::test_cuda_profiles_a_cpu_model_and_moves_it_back" \
  -s -q --timeout 200 2>&1 | tee "$out/gpu_checklist.log"
status=${PIPESTATUS[0]}
grep -oE "CUDA [A-Z]+ .*|[0-9]+ (passed|failed|skipped).*" "$out/gpu_checklist.log" > "$out/gpu_figures.txt"
exit "$status"
