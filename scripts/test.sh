#!/usr/bin/env bash
# The test command: set-up, then the whole suite (unit + integration; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest -q -p no:cacheprovider "$@"
