#!/bin/bash
# On the GPU machine, from the repository root, bench/_sgl carried (see bench/RESULTS.md).
set -u
OUT=${OUT:-/tmp/vcap_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 || \
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/vcapsite . >> "$OUT/install.log" 2>&1; export PYTHONPATH=/tmp/vcapsite
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c 'import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.get_device_name())'
  python3 -c 'import sgl_kernel' 2>&1 | tail -1
  echo "=== pytest tests/engine_hook"; timeout ${T_TEST:-240} python3 -m pytest -q tests/engine_hook -x -p no:cacheprovider; echo "rc=$?"
  echo "=== vcap selftest"; timeout 120 python3 -m vcap.engine_hook.cli selftest; echo "rc=$?"
  echo "=== bench"; timeout ${T_BENCH:-300} python3 bench/bench_hook.py --out "$OUT/bench.json" ${BENCH_ARGS:-}; echo "rc=$?"
} 2>&1 | tee "$OUT/all.log"
