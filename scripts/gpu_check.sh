#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels (.whl/, made by scripts/fetch_gpu_wheels.sh), run the GPU
# tests, then the benchmark. Everything it prints also lands under $OUT.
#   usage: scripts/gpu_check.sh [tests|bench|all] [bench args...]
#          scripts/gpu_check.sh tests [test paths...]   (GPU_TEST_TIMEOUT seconds, default 420)
#          scripts/gpu_check.sh pair   (train the larger demo pair into gpu-pair/, then bench it and demo-pair/)
#          scripts/gpu_check.sh run CMD...   (any command with the carried wheels on its path: soak, profiles)
set -u
what=${1:-all}; shift || true
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$what" = tests ] || [ "$what" = all ]; then
  # The test run itself is timed, not this script, so a test process cannot outlive the limit and
  # keep the GPU's memory from what runs next. One process (-o addopts: not pyproject's two pytest-xdist workers,
  # which would share the GPU, and the carried wheels have no pytest-xdist).
  paths=("$@"); [ "$what" = tests ] && [ $# -gt 0 ] || paths=(tests/gpu)
  timeout --kill-after=10 "${GPU_TEST_TIMEOUT:-420}" python3 -m pytest -o addopts=-ra -m gpu "${paths[@]}" -q -p no:cacheprovider -x --durations=8 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/bench.py --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
if [ "$what" = run ]; then
  "$@"
fi
if [ "$what" = pair ]; then
  # The carried CPU demo pair (demo-pair/) through the demo bench, then the larger trained pair
  # (docs/training.md): target, head, held-out evaluation, and the demo bench on it. Time limits keep
  # the logs coming back.
  for pair in demo-pair gpu-pair; do
    if [ "$pair" = gpu-pair ]; then
      timeout 330 python3 -m tandem.cli demo-models --variant gpu --out gpu-pair 2>&1 | tee "$OUT/pair_train.log"
      cp gpu-pair/draft/training.json "$OUT/pair_draft_training.json" 2>/dev/null
    fi
    [ -f "$pair/draft/config.json" ] || continue
    TANDEM_DEMO_DIR=$pair timeout 120 python3 bench/bench.py --sections demo --out "$OUT/bench_$pair.json" 2>&1 | tee -a "$OUT/pair_bench.log"
  done
fi
