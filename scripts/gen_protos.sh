#!/usr/bin/env bash
# Regenerate the Python stubs for protos/celeris/v1/*.proto into clients/celeris/v1/, where the
# client distribution (clients/pyproject.toml) ships them as the `celeris.v1` package. Generated
# with -I protos so they import each other as celeris.v1...
# tests/unit/server/test_protos.py checks that this changes nothing in the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I protos \
  --python_out=clients --pyi_out=clients --grpc_python_out=clients \
  protos/celeris/v1/generation.proto
