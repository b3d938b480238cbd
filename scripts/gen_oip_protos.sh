#!/usr/bin/env bash
# Regenerate the Open Inference Protocol server's gRPC code (core/dspark/server/oip/protos) from the
# vendored .proto files beside it (Triton's grpc_service.proto and model_config.proto, BSD-3; copied
# unmodified from github.com/triton-inference-server/common, protobuf/).
#
# The generator is pinned (grpcio-tools 1.66.0, protoc 27.2) and runs in a throwaway venv, never the
# project's: its gencode then loads on every protobuf >= 5.27.2 and grpcio >= 1.66.0 (the floors in
# pyproject.toml), and installing it cannot move the project's protobuf. grpcio-tools is no run-time need.
#
# Two edits after generation, both mechanical:
#  - imports made package-relative (protoc writes `import model_config_pb2`, a top-level module);
#  - the messages are built in the package's own descriptor pool (protos.POOL), not protobuf's default
#    one, so that another copy of the same .proto in the process (tritonclient's, a KServe server's)
#    cannot clash with ours ("duplicate file name" / "duplicate symbol").
#
# Usage: bash scripts/gen_oip_protos.sh [PYTHON]   (PYTHON: an interpreter for the throwaway venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-$(command -v python3.11 || command -v python3)}"
OUT=core/dspark/server/oip/protos
TOOLS_VERSION=1.66.0
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet --disable-pip-version-check "grpcio-tools==$TOOLS_VERSION" 2>&1 \
  | grep -v "^WARNING: Location 'file:" || true
mkdir -p "$WORK/out"
(cd "$OUT" && "$WORK/venv/bin/python" -m grpc_tools.protoc -I. --python_out="$WORK/out" model_config.proto)
(cd "$OUT" && "$WORK/venv/bin/python" -m grpc_tools.protoc -I. --python_out="$WORK/out" \
  --grpc_python_out="$WORK/out" grpc_service.proto)
"$WORK/venv/bin/python" - "$WORK/out" "$OUT" <<'EOF'
import pathlib, re, sys

src, dst = map(pathlib.Path, sys.argv[1:])
for name in ("model_config_pb2.py", "grpc_service_pb2.py", "grpc_service_pb2_grpc.py"):
    text = (src / name).read_text()
    text = re.sub(r"^import (\w+_pb2) as (\w+)$", r"from . import \1 as \2", text, flags=re.M)
    if name.endswith("_pb2.py"):
        old = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
        assert old in text, f"{name}: protoc's output changed; update this script"
        text = text.replace(old, "DESCRIPTOR = _OIP_POOL.AddSerializedFile(")
        text = text.replace("# @@protoc_insertion_point(imports)",
                            "from . import POOL as _OIP_POOL  # scripts/gen_oip_protos.sh: the package's own pool\n"
                            "# @@protoc_insertion_point(imports)", 1)
    (dst / name).write_text(text)
    print(f"wrote {dst / name}")
EOF
