#!/usr/bin/env bash
# Installs everything Celeris needs on a fresh machine. torch first (scripts/install_torch.sh:
# the CPU build without a GPU, the CUDA one with), so pip never resolves the multi-GB CUDA build
# as a mere dependency; it says which build it installed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_torch.sh
# The server (editable, with the test tools) pulls the client from ./clients as a regular install;
# reinstalling the client editable afterwards makes edits under clients/ take effect too.
python3 -m pip install --quiet -e '.[dev]'
python3 -m pip install --quiet --no-deps -e ./clients
# Headless Chromium for the web page's browser test (Debian packages; CI runs this as root).
if { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; } && command -v apt-get >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; } \
    || echo "setup.sh: could not install chromium; the browser test will skip (and fail under CI)" >&2
fi
