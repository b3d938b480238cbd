#!/usr/bin/env bash
# llama-cpp-python for the llamacpp plugin (plugins/dspark-llamacpp), built once per machine and cached.
#
# Built from its sdist with GGML_NATIVE, so llama.cpp's kernels use this CPU's own features (the PyPI
# wheels that exist are AVX2-only or need a newer glibc; see the plugin's README). The build takes about
# 8 minutes on 2 cores; the wheel is kept under $DSPARK_WHEEL_CACHE (default ~/.cache/dspark/wheels) in a
# folder keyed by the version, the build flags, the compiler and this CPU's feature flags, so a machine
# with another CPU builds its own. The sdist is patched first with scripts/patches/llama-cpp-python-$V/*.patch
# (each says what it fixes; their contents are part of the key). Prints the wheel's path on its last line.
#
# Usage: bash scripts/llamacpp_wheel.sh PYTHON
set -euo pipefail
PY="$1"
V="${LLAMACPP_VERSION:-0.3.36}"
ARGS="${LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAVA_BUILD=OFF}"
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)"
PATCHES="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/patches/llama-cpp-python-$V"
PATCHED="$(cat "$PATCHES"/*.patch 2>/dev/null | sha256sum | cut -c1-16)"
KEY="$(printf '%s\n%s\n%s\n%s\n%s\n' "$V" "$ARGS" "$(gcc --version 2>/dev/null | head -n1)" "$FLAGS" "$PATCHED" \
  | sha256sum | cut -c1-16)"
DIR="${DSPARK_WHEEL_CACHE:-$HOME/.cache/dspark/wheels}/llama-cpp-python-$V-$KEY"
WHEEL="$(ls "$DIR"/llama_cpp_python-"$V"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$WHEEL" ]; then
  mkdir -p "$DIR"
  echo "building llama-cpp-python $V for this CPU (about 8 minutes on 2 cores; cached in $DIR)" >&2
  LOG="$DIR/build.log"
  rm -rf "$DIR.src" && mkdir -p "$DIR.src"
  if ! "$PY" -m pip download --quiet --no-deps --no-binary :all: --disable-pip-version-check -d "$DIR.src" \
      "llama-cpp-python==$V" >"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "llama-cpp-python $V: its sdist did not download (log: $LOG)" >&2
    exit 1
  fi
  tar -xzf "$DIR.src"/llama_cpp_python-"$V".tar.gz -C "$DIR.src"
  SRC="$DIR.src/llama_cpp_python-$V"
  for P in "$PATCHES"/*.patch; do
    if [ -f "$P" ]; then patch -d "$SRC" -p1 --forward --quiet < "$P"; fi
  done
  if ! CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip wheel --quiet --no-deps \
      --disable-pip-version-check -w "$DIR.tmp" "$SRC" >>"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "llama-cpp-python $V did not build (log: $LOG)" >&2
    exit 1
  fi
  mv "$DIR.tmp"/llama_cpp_python-"$V"-*.whl "$DIR"/ && rm -rf "$DIR.tmp" "$DIR.src"
  WHEEL="$(ls "$DIR"/llama_cpp_python-"$V"-*.whl | head -n1)"
fi
echo "$WHEEL"
