#!/bin/bash
# On the GPU machine, from the repository root, with .whl and .sglwheel carried (docs/sglang.md):
# SGLang 0.5.23's wheel unzipped onto PYTHONPATH (its cp311 Rust extensions left out), the
# pure-Python packages its modules import, vcap, then the gpu-marked SGLang tests.
set -u
OUT=${OUT:-/tmp/vcap_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > "$OUT/install.log" 2>&1
python3 - <<'PY' >> "$OUT/install.log" 2>&1
import glob, zipfile
with zipfile.ZipFile(glob.glob(".sglwheel/sglang-0.5.23-*.whl")[0]) as wheel:
    wheel.extractall("/tmp/sgl", [n for n in wheel.namelist() if not n.endswith(".so")])
PY
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/vcapsite . >> "$OUT/install.log" 2>&1
export PYTHONPATH=$PWD/bench/sglang_gpu/standins:/tmp/vcapsite:/tmp/sgl:/tmp/site
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch,triton,sglang;print(torch.__version__,triton.__version__,torch.cuda.get_device_name(),sglang.__file__)'
  echo "=== gpu tests through SGLang's own code"
  timeout ${T_TEST:-420} python3 -m pytest -q -p no:cacheprovider -rA tests/sglang/test_gpu_sglang.py \
      tests/engine_hook/test_router.py 2>&1 | grep -v "Warning\|warnings.warn"
  echo "rc=${PIPESTATUS[0]}"
} 2>&1 | tee "$OUT/all.log"
