#!/bin/bash
# On the GPU machine, from the repository root; carry .whl, .sglwheel and bench/_sgl (bench/LOOP_RESULTS.md).
set -u
OUT=${OUT:-/tmp/vcap_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 || echo "vcap install failed"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$OUT/install.log" 2>&1 || echo "wheel deps install failed"
  # the SGLang wheel is cp311: unzip its Python onto PYTHONPATH (its Rust extensions are never loaded)
  python3 -c "import zipfile,glob; z=zipfile.ZipFile(glob.glob('.sglwheel/sglang-0.5.23-*.whl')[0]); \
z.extractall('/tmp/sglpy', [n for n in z.namelist() if not n.endswith('.so')])"
  export PYTHONPATH=/tmp/sglpy:/tmp/site
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "=== pytest tests/test_gpu_engine.py"; timeout 150 python3 -m pytest -q tests/test_gpu_engine.py -p no:cacheprovider; echo "rc=$?"
  echo "=== bench_loop"; timeout ${T_LOOP:-300} python3 bench/bench_loop.py --out "$OUT/loop.json" ${LOOP_ARGS:-}; echo "rc=$?"
} 2>&1 | tee "$OUT/loop.log"
