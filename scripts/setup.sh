#!/usr/bin/env bash
# Installs everything Celeris needs on a fresh machine. torch is pinned first so pip takes the
# local CPU build instead of resolving a multi-GB CUDA build as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet torch==2.13.0
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
