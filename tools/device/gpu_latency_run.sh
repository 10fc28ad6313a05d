#!/usr/bin/env bash
# One device call (fits the 600 s per-call limit on a cold machine) for the latency figures that
# tools/device/gpu_short_run.sh leaves out, each part bounded and its files under $OUT/results as
# it ends:
#   1. the host path of one small online step, piece by piece (tools/profiling/launch_path.py),
#      MiniLM shape at 20 tokens, then the BGE-M3 shape at 128;
#   2. the lanes through the server with the BGE-M3 shape (128-token queries), stages traced;
#   3. batch-1 latency of MiniLM at 32 tokens and the pplx-0.6b shape at 128 (TCP and Unix socket);
#   4. the GPU tests, verbose, with a JUnit file, with whatever time is left.
# Usage (repository root, carry .whl .gpu): bash tools/device/gpu_latency_run.sh
set -uo pipefail
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
until_s() { echo $(( $1 - $(elapsed) )); }  # seconds left until $1 s into the run
source tools/device/gpu_env.sh || exit 1
R=$OUT/results
python3 -c "from benchmarks.models import build_random_model as b; b('minilm', '/tmp/fern-models/minilm'); b('bge-m3', '/tmp/fern-models/bge-m3')" || exit 1
echo "ready at $(elapsed) s"
timeout 60 python3 -m tools.profiling.launch_path --model /tmp/fern-models/minilm --tokens 20 \
  --out "$R/launch_path-minilm.json" > "$R/launch_path-minilm.log" 2>&1
echo "launch_path minilm: exit $? at $(elapsed) s"
timeout "$(until_s 150)" python3 -m tools.profiling.launch_path --model /tmp/fern-models/bge-m3 --tokens 128 \
  --out "$R/launch_path-bge-m3.json" > "$R/launch_path-bge-m3.log" 2>&1
echo "launch_path bge-m3: exit $? at $(elapsed) s"
timeout "$(until_s 360)" python3 -m benchmarks.lanes_e2e --device cuda --model /tmp/fern-models/bge-m3 --online-tokens 128 \
  --rounds 2 --trace --out "$R/lanes_e2e-bge-m3.json" > "$R/lanes-bge-m3.log" 2>&1
echo "lanes bge-m3: exit $? at $(elapsed) s"; tail -2 "$R/lanes-bge-m3.log"
timeout "$(until_s 440)" python3 -m benchmarks.cli --suite gpu --only latency --latency-models minilm --latency-lengths 32 \
  --out "$R" --models-dir /tmp/fern-models --tag minilm > "$R/latency-minilm.log" 2>&1
echo "latency minilm: exit $? at $(elapsed) s"; grep "^latency" "$R/latency-minilm.log"
timeout "$(until_s 520)" python3 -m benchmarks.cli --suite gpu --only latency --latency-models pplx-0.6b --latency-lengths 128 \
  --out "$R" --models-dir /tmp/fern-models --tag pplx > "$R/latency-pplx.log" 2>&1
echo "latency pplx-0.6b: exit $? at $(elapsed) s"; grep "^latency" "$R/latency-pplx.log"
if [ "$(until_s 580)" -gt 20 ]; then  # SIGINT: pytest still writes its summary and the JUnit file
  timeout -s INT "$(until_s 580)" python3 -m pytest -v -p no:cacheprovider -m gpu --junitxml="$R/gpu-tests.xml" \
    tests/core_engine/test_gpu_rerank.py tests/core_engine/test_bge_m3_heads.py tests/core_engine/test_gpu.py \
    > "$R/gpu-tests.log" 2>&1
  echo "gpu tests: exit $? at $(elapsed) s"; grep -E "passed|failed" "$R/gpu-tests.log" | tail -3
fi
ls -la "$R"
