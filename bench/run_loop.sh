#!/bin/bash
# On the GPU machine, from the repository root; carry .whl, .sglwheel, bench/_sgl and .whlgrpc
# (grpcio, grpcio-health-checking, grpcio-reflection and protobuf wheels for the sidecar), and
# optionally .devsnap (`git archive HEAD` of the code paths, laid over the tree so that
# uncommitted work in the checkout does not travel into the results). bench/LOOP_RESULTS.md.
#
# Every step has its own time limit and writes its own output, so a cut run still produces results:
#   T_LOOP (bench_loop.py, s; skip), LOOP_ARGS, LAT_CHANGES, LAT_ARGS (engine flags of the flat-out
#   latency run), LAT_PACED_ARGS ('' skips the paced run), EVAL_TRACES (eval_controller.py's traces
#   on the GPU engine, space-separated), T_EVAL (s per trace), EVAL_ARGS, EVAL_PY (the command
#   eval_controller.py runs under: python3, or a wrapper such as 'python3 bench/forced_forget.py --at 43 --').
set -u
OUT=${OUT:-/tmp/vcap_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u +%FT%TZ
  if [ -d .devsnap/tree ]; then
    cp -r .devsnap/tree/. . && echo "code from commit $(cat .devsnap/HEAD 2>/dev/null)"
  fi
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 || echo "vcap install failed"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .whlgrpc/*.whl 2>/dev/null) >> "$OUT/install.log" 2>&1 || echo "wheel deps install failed"
  # the SGLang wheel is cp311: unzip its Python onto PYTHONPATH (its Rust extensions are never loaded)
  python3 -c "import zipfile,glob; z=zipfile.ZipFile(glob.glob('.sglwheel/sglang-0.5.23-*.whl')[0]); \
z.extractall('/tmp/sglpy', [n for n in z.namelist() if not n.endswith('.so')])"
  export PYTHONPATH=/tmp/sglpy:/tmp/site
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import grpc, google.protobuf, vcap.sidecar.app; print('grpc', grpc.__version__, 'protobuf', google.protobuf.__version__)"
  # T_TEST=skip / T_LAT=skip leave a step out
  if [ "${T_TEST:-}" != skip ]; then
    echo "=== pytest tests/test_gpu_engine.py"
    timeout ${T_TEST:-120} python3 -m pytest -q tests/test_gpu_engine.py -p no:cacheprovider -k "not device_cpu"; echo "rc=$?"
  fi
  if [ "${T_LAT:-}" != skip ]; then
    echo "=== control latency, flat out (vcap-sidecar --simulate -- --device cuda ...)"
    timeout ${T_LAT:-75} python3 bench/bench_control_latency.py --changes ${LAT_CHANGES:-200} --gap-ms 10,40 \
      --out "$OUT/latency_flat.json" -- --device cuda --time-scale 0 --load-noise 0 ${LAT_ARGS:---mean-bs 16 --routing zipf:1.2}
    echo "rc=$?"
  fi
  if [ "${T_LOOP:-}" != skip ]; then
    echo "=== bench_loop"
    timeout ${T_LOOP:-300} python3 bench/bench_loop.py --out "$OUT/loop.json" ${LOOP_ARGS:-}; echo "rc=$?"
  fi
  # EVAL_TRACES: eval_controller's traces on the GPU engine, one process (and one result file) each
  for trace in ${EVAL_TRACES:-}; do
    echo "=== eval_controller --device cuda --only $trace"
    timeout ${T_EVAL:-270} ${EVAL_PY:-python3} bench/eval_controller.py --device cuda --only "$trace" ${EVAL_ARGS:-} \
      --json "$OUT/eval_$trace.json" --controller-log "$OUT/controller_$trace.log"; echo "rc=$?"
  done
  if [ "${T_LAT:-}" != skip ] && [ -n "${LAT_PACED_ARGS-x}" ]; then
    echo "=== control latency, at the full-model pace (--time-scale 1)"
    timeout ${T_LAT_PACED:-75} python3 bench/bench_control_latency.py --changes ${LAT_CHANGES:-200} --gap-ms 30,150 \
      --out "$OUT/latency_paced.json" -- --device cuda --time-scale 1 --load-noise 0 ${LAT_PACED_ARGS:---mean-bs 16 --routing zipf:1.2}
    echo "rc=$?"
  fi
  date -u +%FT%TZ
} 2>&1 | tee "$OUT/loop.log"
