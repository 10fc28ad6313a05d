#!/usr/bin/env bash
# One device run: carried wheels + FlashInfer (tools/device/gpu_env.sh), GPU tests, then
# `fern bench --suite gpu`; results and the compile caches land under $OUT.
# Usage (repository root): bash tools/device/gpu_run.sh [bench args...]. FERN_GPU_TESTS=0 skips the
# tests, FERN_RERANK_BENCH=0 the reranking benchmark (benchmarks/rerank.py).
set -uo pipefail
source tools/device/gpu_env.sh || exit 1
if [ "${FERN_GPU_TESTS:-1}" != 0 ]; then
  start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/core_engine/test_gpu.py tests/core_engine/test_gpu_rerank.py \
    tests/core_engine/test_bge_m3_heads.py 2>&1 | tee "$OUT/results/gpu-tests.log" | tail -40
  echo "GPU tests took $(( $(date +%s) - start )) s"
fi
python3 -m benchmarks.cli --suite gpu --out "$OUT/results" --models-dir /tmp/fern-models "$@"
[ "${FERN_RERANK_BENCH:-1}" != 0 ] && python3 -m benchmarks.rerank --out "$OUT/results/rerank.json"
tar -C "$OUT" -czf "$OUT/results.tar.gz" results && rm -rf "$OUT/results"
fern_save_caches
ls -la "$OUT"
