#!/usr/bin/env bash
# Installs the torch build this machine can use (scripts/setup.sh runs it first, on purpose):
# PyPI's Linux torch wheel is the CUDA build (several GB of nvidia-* wheels), which a machine
# without a GPU cannot use. So without a GPU torch comes from PyTorch's CPU index (what the CPU
# image installs); where that index cannot be reached (an air-gapped mirror, CI behind PyPI only)
# it comes from pip's configured index, and the line at the end says which build that gave.
# CELERIS_TORCH=cpu|cuda overrides the GPU check.
set -euo pipefail
TORCH_SPEC="torch==2.13.0"
CPU_INDEX="${CELERIS_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

has_gpu() {  # an NVIDIA driver that sees a device
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

index_reachable() {  # one quick request: an unreachable index must not cost pip's retries (minutes)
  python3 - "$1" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
PY
}

want="${CELERIS_TORCH:-}"
if [ -z "$want" ]; then if has_gpu; then want=cuda; else want=cpu; fi; fi
if [ "$want" = cpu ] && index_reachable "$CPU_INDEX"; then
  source="PyTorch's CPU index ($CPU_INDEX)"
  python3 -m pip install --quiet --index-url "$CPU_INDEX" "$TORCH_SPEC"
else
  if [ "$want" = cpu ]; then
    source="pip's default index (PyTorch's CPU index $CPU_INDEX is unreachable)"
  else
    source="pip's default index (whose Linux wheel is the CUDA build)"
  fi
  python3 -m pip install --quiet "$TORCH_SPEC"
fi
# The build is read from torch/version.py, without importing torch: numpy is not installed yet
# (setup.sh installs it next), and importing torch without it warns "Failed to initialize NumPy".
built=$(python3 - <<'PY'
import importlib.util, pathlib
ns = {}
exec(pathlib.Path(importlib.util.find_spec("torch").origin).with_name("version.py").read_text(), ns)
print(ns["__version__"], "CUDA " + ns["cuda"] if ns.get("cuda") else "CPU only")
PY
)
echo "install_torch.sh: torch for $want from $source: installed torch $built"
case "$want:$built" in
  cpu:*CUDA*) echo "install_torch.sh: this is a CUDA build on a machine without a GPU; for the smaller CPU build run" \
                   "pip install --index-url $CPU_INDEX $TORCH_SPEC where that index is reachable" ;;
  cuda:*"CPU only") echo "install_torch.sh: a CPU build is installed though a GPU is present; for CUDA run" \
                   "pip install --force-reinstall --index-url https://download.pytorch.org/whl/cu130 $TORCH_SPEC" ;;
esac
