#!/usr/bin/env bash
# llama.cpp for benchmarks/vs_openvino_genai.py (not in CI): llama-cpp-python built from its sdist in a
# venv of its own, and the benchmark's checkpoints as GGUF files written by llama.cpp's own converter.
#
# Usage: bash benchmarks/llamacpp_setup.sh        (from anywhere; ~15-30 min to build on 2 cores)
#   LLAMACPP_VERSION=0.3.36  CMAKE_ARGS=...  JOBS=2  PYTHON=python3.11  override the defaults
#
# Layout under benchmarks/out/llamacpp/:
#   sdist/llama_cpp_python-$V.tar.gz  the sdist (pip download --no-binary :all:)
#   src/llama_cpp_python-$V/          it unpacked: vendor/llama.cpp holds convert_hf_to_gguf.py and gguf-py
#   venv/                             python -m venv; llama-cpp-python built from the sdist (CPU, GGML_NATIVE)
#   convert-deps/                     sentencepiece only (pip --target), which the converter imports
#   gguf/{stdlib-llama,random-90m}-{f32,bf16}.gguf
#   READY                             written last; the benchmark runs llama.cpp only when it exists
#
# Conversion runs the sdist's convert_hf_to_gguf.py with the project's .venv python (it has the torch and
# transformers the converter imports) and the sdist's own gguf-py first on PYTHONPATH. One deviation: the
# converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know (the embedded model's is
# trained here), so a small shim sets the pre-tokenizer to "gpt-2" (the same ByteLevel regex split). The
# benchmark feeds token ids, never text, so the tokenizer's pre-tokenizer plays no part in the timings.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
V="${LLAMACPP_VERSION:-0.3.36}"
OUTD="$HERE/out/llamacpp"
PROJ_PY="$ROOT/.venv/bin/python"
PY="${PYTHON:-$PROJ_PY}"   # the interpreter the new venv is made from (the project's, by default)
JOBS="${JOBS:-2}"
NICE="nice -n 19"

mkdir -p "$OUTD/sdist" "$OUTD/src" "$OUTD/gguf"
rm -f "$OUTD/READY"

echo "== sdist llama-cpp-python==$V"
SDIST="$OUTD/sdist/llama_cpp_python-$V.tar.gz"
if [ ! -f "$SDIST" ]; then
  $NICE "$PROJ_PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$V" -d "$OUTD/sdist"
fi
SRC="$OUTD/src/llama_cpp_python-$V"
# The same patches as the plugin's build: a tree and venv made with other patches are made again, so the
# benchmark's llama.cpp runs the plugin's kernels (a stamp of the patches' hash beside the tree).
PATCHED="$(cat "$ROOT/scripts/patches/llama-cpp-python-$V"/*.patch 2>/dev/null | sha256sum | cut -c1-16)"
STAMP="$OUTD/src/PATCHES-$V"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$PATCHED" ]; then
  rm -rf "$SRC" "$OUTD/venv"
fi
if [ ! -d "$SRC" ]; then
  tar -xzf "$SDIST" -C "$OUTD/src"
  # The plugin's patches (scripts/llamacpp_wheel.sh): without them llama.cpp's AMX kernels fault on AMX CPUs.
  for P in "$ROOT/scripts/patches/llama-cpp-python-$V"/*.patch; do
    if [ -f "$P" ]; then patch -d "$SRC" -p1 --forward --quiet < "$P"; fi
  done
  echo "$PATCHED" > "$STAMP"
fi

echo "== venv and build (CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON}, $JOBS jobs)"
if [ ! -x "$OUTD/venv/bin/python" ]; then
  "$PY" -m venv "$OUTD/venv"
fi
"$OUTD/venv/bin/python" -m pip install -q --upgrade pip
if ! "$OUTD/venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
    $NICE "$OUTD/venv/bin/python" -m pip install -v --no-cache-dir "$SRC" 2>&1 | tail -n 40
fi
"$OUTD/venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"

echo "== GGUF conversion (the sdist's convert_hf_to_gguf.py)"
LCPP="$SRC/vendor/llama.cpp"
if [ ! -d "$OUTD/convert-deps/sentencepiece" ]; then
  $NICE "$PROJ_PY" -m pip install -q --no-deps --target "$OUTD/convert-deps" sentencepiece
fi
SHIM="$OUTD/convert_shim.py"
cat > "$SHIM" <<'EOF'
"""Run llama.cpp's convert_hf_to_gguf.py with the BPE pre-tokenizer fixed to "gpt-2" (see llamacpp_setup.sh)."""
import runpy
import sys

lcpp = sys.argv[1]
sys.path.insert(0, lcpp)
from conversion.base import TextModel  # noqa: E402

TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [f"{lcpp}/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
# The random-weight checkpoint the benchmark uses (built once, seeded).
$NICE "$PROJ_PY" "$HERE/rand_model.py" >/dev/null
for model in "$ROOT/core/dspark/assets/models/stdlib-llama" "$HERE/out/models/random-90m"; do
  name="$(basename "$model")"
  for t in f32 bf16; do
    dst="$OUTD/gguf/$name-$t.gguf"
    if [ ! -f "$dst" ] || [ "$model/model.safetensors" -nt "$dst" ]; then
      PYTHONPATH="$LCPP/gguf-py:$OUTD/convert-deps" $NICE "$PROJ_PY" "$SHIM" "$LCPP" "$model" \
        --outtype "$t" --outfile "$dst.tmp" 2>&1 | tail -n 2
      mv "$dst.tmp" "$dst"
    fi
    echo "  $dst"
  done
done

date -u +"%Y-%m-%dT%H:%M:%SZ llama-cpp-python $V" > "$OUTD/READY"
echo "== ready: $OUTD"
