#!/usr/bin/env bash
# llama-server for benchmarks/vs_llamacpp.py (not in CI): built from the same llama.cpp source as the
# plugin's llama-cpp-python (the sdist's vendor/llama.cpp, patched as scripts/llamacpp_wheel.sh patches it),
# with the same native CPU flags.
#
# Usage: bash benchmarks/llamacpp_server.sh      (about 15 minutes on 2 cores; prints the binary's path)
#   LLAMACPP_VERSION=0.3.36  JOBS=2  override the defaults
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
V="${LLAMACPP_VERSION:-0.3.36}"
OUTD="$HERE/out/llamacpp"
JOBS="${JOBS:-$(nproc)}"
BIN="$OUTD/server-build/bin/llama-server"
# The same patches as the plugin's build (scripts/llamacpp_wheel.sh), so both run the same kernels: a build
# made with other patches is made again.
PATCHES="$ROOT/scripts/patches/llama-cpp-python-$V"
PATCHED="$(cat "$PATCHES"/*.patch 2>/dev/null | sha256sum | cut -c1-16)"
STAMP="$OUTD/server-build/PATCHES"
if [ -x "$BIN" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$PATCHED" ]; then echo "$BIN"; exit 0; fi
rm -rf "$OUTD/server-src" "$OUTD/server-build"
mkdir -p "$OUTD/sdist" "$OUTD/server-src"
SDIST="$OUTD/sdist/llama_cpp_python-$V.tar.gz"
[ -f "$SDIST" ] || "$ROOT/.venv/bin/python" -m pip download --quiet --no-deps --no-binary :all: \
  "llama-cpp-python==$V" -d "$OUTD/sdist" >&2
tar -xzf "$SDIST" -C "$OUTD/server-src"
for P in "$PATCHES"/*.patch; do
  if [ -f "$P" ]; then patch -d "$OUTD/server-src/llama_cpp_python-$V" -p1 --forward --quiet < "$P"; fi
done
SRC="$OUTD/server-src/llama_cpp_python-$V/vendor/llama.cpp"
cmake -S "$SRC" -B "$OUTD/server-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF >&2
nice -n 10 cmake --build "$OUTD/server-build" --target llama-server -j "$JOBS" >&2
echo "$PATCHED" > "$STAMP"
echo "$BIN"
