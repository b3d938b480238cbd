#!/usr/bin/env bash
# Exercise the CUDA plugin on a machine with an NVIDIA GPU.
# Usage: scripts/gpu_check.sh   (writes logs to $OUT, or ./gpu_check_out)
# Reuses .venv when it already has dspark installed; otherwise creates it
# (the normal torch range brings a CUDA build of torch on Linux x86_64).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$out"
export DSPARK_CACHE_DIR="$out/cache"  # fresh: the microbenchmarks really run

if [ ! -x .venv/bin/dspark ]; then
    { python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'; } >"$out/install.log" 2>&1 \
        || { echo "install failed, see $out/install.log"; tail -20 "$out/install.log"; exit 2; }
fi

{ nvidia-smi || true; } >"$out/nvidia-smi.txt" 2>&1
.venv/bin/python - >"$out/torch.txt" 2>&1 <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    print(i, torch.cuda.get_device_properties(i))
PY
cat "$out/torch.txt"

status=0
TIMEFORMAT="%R s"
echo -n "dspark devices --json (cold cache, runs microbenchmarks): "
time { .venv/bin/dspark devices --json >"$out/devices.json" 2>"$out/devices.stderr" || status=1; }
echo -n "dspark devices (warm cache): "
time { .venv/bin/dspark devices >"$out/devices.txt" 2>&1 || status=1; }
cat "$out/devices.txt"

.venv/bin/pytest -q -rs tests/plugins/test_cuda.py 2>&1 | tee "$out/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# The Triton quantization kernels compiled on the GPU; -s prints their per-call timings.
.venv/bin/pytest -q -rs -s tests/plugins/test_cuda_triton_quant.py 2>&1 | tee "$out/pytest_triton_quant.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# The whole decoder (torch + Triton paged attention + CUDA graphs) against the torch reference, compiled
# on the GPU: the test module only falls back to Triton's interpreter where CUDA is absent or
# TRITON_INTERPRET=1 is set, so make sure it is not.
env -u TRITON_INTERPRET .venv/bin/pytest -q -rs tests/plugins/test_cuda_decoder.py 2>&1 | tee "$out/pytest_decoder.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
