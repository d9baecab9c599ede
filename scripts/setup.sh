#!/usr/bin/env bash
# Installs everything Celeris needs on a fresh machine. torch is pinned first so pip takes the
# local CPU build instead of resolving a multi-GB CUDA build as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet torch==2.13.0
python3 -m pip install --quiet -e '.[dev]'
