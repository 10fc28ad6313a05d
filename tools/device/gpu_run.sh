#!/usr/bin/env bash
# One device run: carried wheels + FlashInfer (tools/device/gpu_env.sh), GPU tests, then
# `fern bench --suite gpu`; results and the compile caches land under $OUT.
# Usage (repository root): bash tools/device/gpu_run.sh [bench args...]. FERN_GPU_TESTS=0 skips the
# tests, FERN_RERANK_BENCH=0 the reranking benchmark (benchmarks/rerank.py), FERN_LANES_BENCH=0 the lanes
# through the server (benchmarks/lanes_e2e.py with each query's stages traced: MiniLM, then the BGE-M3 shape). The suite's capture part also starts a server with
# --compile-in-background, so each run says whether that start is ready to be the default.
set -uo pipefail
source tools/device/gpu_env.sh || exit 1
if [ "${FERN_GPU_TESTS:-1}" != 0 ]; then
  start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/core_engine/test_gpu.py tests/core_engine/test_gpu_rerank.py \
    tests/core_engine/test_bge_m3_heads.py 2>&1 | tee "$OUT/results/gpu-tests.log" | tail -40
  echo "GPU tests took $(( $(date +%s) - start )) s"
fi
python3 -m benchmarks.cli --suite gpu --out "$OUT/results" --models-dir /tmp/fern-models --capture-compile-in-background "$@"
[ "${FERN_RERANK_BENCH:-1}" != 0 ] && python3 -m benchmarks.rerank --out "$OUT/results/rerank.json"
# MiniLM: the suite's random-weight copy where the bundled package is not installed, else the package's.
minilm=(); [ -d /tmp/fern-models/minilm ] && minilm=(--model /tmp/fern-models/minilm)
if [ "${FERN_LANES_BENCH:-1}" != 0 ]; then
  python3 -m benchmarks.lanes_e2e --device cuda "${minilm[@]}" --rounds 2 --trace --st-baseline --out "$OUT/results/lanes_e2e.json"
  python3 -c "from benchmarks.models import build_random_model; build_random_model('bge-m3', '/tmp/fern-models/bge-m3')"
  python3 -m benchmarks.lanes_e2e --device cuda --model /tmp/fern-models/bge-m3 --online-tokens 128 --rounds 2 --trace \
    --out "$OUT/results/lanes_e2e-bge-m3.json"
fi
tar -C "$OUT" -czf "$OUT/results.tar.gz" results && rm -rf "$OUT/results"
fern_save_caches
ls -la "$OUT"
