#!/usr/bin/env bash
# One device call that fits the 600 s per-call limit on a cold machine, most wanted figures first,
# each part bounded so that a slow one cannot take the others' time and every finished part's
# files are already under $OUT/results if the call is cut short:
#   1. the lanes through the server with each query's stages traced (MiniLM shape, random weights), then
#      sentence-transformers on the same passage lengths;
#   2. batch-1 latency of the BGE-M3 shape at 128 tokens: engine, TCP and Unix socket;
#   3. reranking throughput (benchmarks/rerank.py, fewer queries) if 140 s are left.
# Usage (repository root, carry .whl .gpu): bash tools/device/gpu_short_run.sh
# tools/device/gpu_run.sh is the full run (GPU tests and the whole suite), for a call with time to spare.
set -uo pipefail
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
source tools/device/gpu_env.sh || exit 1
R=$OUT/results
python3 -c "from benchmarks.models import build_random_model as b; b('minilm', '/tmp/fern-models/minilm'); b('bge-m3', '/tmp/fern-models/bge-m3')" || exit 1
echo "ready at $(elapsed) s"
timeout 290 python3 -m benchmarks.lanes_e2e --device cuda --model /tmp/fern-models/minilm --rounds 2 --trace --st-baseline \
  --out "$R/lanes_e2e.json" > "$R/lanes.log" 2>&1
echo "lanes: exit $? at $(elapsed) s"; tail -5 "$R/lanes.log"
timeout $(( 545 - $(elapsed) )) python3 -m benchmarks.cli --suite gpu --only latency --latency-models bge-m3 \
  --latency-lengths 128 --out "$R" --models-dir /tmp/fern-models --tag bge-m3 > "$R/latency.log" 2>&1
echo "latency: exit $? at $(elapsed) s"; tail -20 "$R/latency.log"
left=$(( 575 - $(elapsed) ))
if [ "$left" -gt 140 ]; then
  timeout "$left" python3 -m benchmarks.rerank --rounds 2 --queries 12 --out "$R/rerank.json" > "$R/rerank.log" 2>&1
  echo "rerank: exit $? at $(elapsed) s"; tail -30 "$R/rerank.log"
fi
ls -la "$R"
