#!/usr/bin/env bash
# Regenerate the Python stubs for protos/celeris/v1/*.proto beside the .proto
# files. Generated with -I protos so they import each other as celeris.v1...
# tests/unit/test_protos.py checks that this changes nothing in the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I protos \
  --python_out=protos --pyi_out=protos --grpc_python_out=protos \
  protos/celeris/v1/generation.proto
