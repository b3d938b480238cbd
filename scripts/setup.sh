#!/usr/bin/env bash
# Create .venv and install dspark with its test tools. On machines without a
# GPU the constraints file pins the CPU build of torch (found on local disk
# through pip's find-links); elsewhere pip resolves torch normally.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
CONSTRAINTS=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  CONSTRAINTS=(-c constraints/cpu.txt)
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "${CONSTRAINTS[@]}" -e '.[dev]' 2>&1 \
  | grep -v "^WARNING: Location 'file:" || true
# jax2onnx (the JAX importer; its other needs come with the dev extra's dspark[jax]) without its
# dependencies: it requires the onnxruntime distribution, which would overwrite onnxruntime-gpu's files.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps 'jax2onnx>=0.17,<0.18' 2>&1 \
  | grep -v "^WARNING: Location 'file:" || true
# The llamacpp plugin (plugins/dspark-llamacpp, its own distribution): llama-cpp-python built for this CPU
# once (scripts/llamacpp_wheel.sh caches the wheel), then the plugin, found through its entry point.
WHEEL="$(bash scripts/llamacpp_wheel.sh .venv/bin/python | tail -n1)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check "${CONSTRAINTS[@]}" "$WHEEL" \
  -e plugins/dspark-llamacpp 2>&1 | grep -v "^WARNING: Location 'file:" || true
# Same version, other build (a wheel built before its patches, or for another CPU): pip would keep it.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$WHEEL" 2>&1 \
  | grep -v "^WARNING: Location 'file:" || true
.venv/bin/python -c "import dspark, torch, openvino, onnxruntime, llama_cpp; print('dspark', dspark.__version__, '| torch', torch.__version__, '| llama-cpp-python', llama_cpp.__version__)"
