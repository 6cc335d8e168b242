#!/usr/bin/env bash
# Real load clients, each in its own venv outside any clone (CI reuses them):
#   ~/.cache/mmserve/aiperf-venv   (aiperf 0.13.0)      ~/.cache/mmserve/guidellm-venv (guidellm 0.8.1)
# Idempotent: a venv whose tool already imports is left alone. Never a dependency of mmserve.
# Usage: bash scripts/load_clients.sh [aiperf|guidellm|all]   (default aiperf)
set -euo pipefail
CACHE=${MMSERVE_CACHE_DIR:-$HOME/.cache/mmserve}
PY=${PYTHON:-python3}
want=${1:-aiperf}

install() {  # name, pip spec, import check
  local venv="$CACHE/$1-venv"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$3" 2>/dev/null; then
    echo "[load-clients] $1 ready in $venv" >&2
    return
  fi
  echo "[load-clients] installing $2 into $venv" >&2
  mkdir -p "$CACHE"
  (
    flock 9
    "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "$2"
  ) 9>"$venv.lock"
  "$venv/bin/python" -c "$3"
}

case "$want" in
  aiperf) install aiperf "aiperf==0.13.0" "import aiperf" ;;
  guidellm) install guidellm "guidellm==0.8.1" "import guidellm" ;;
  all) install aiperf "aiperf==0.13.0" "import aiperf"; install guidellm "guidellm==0.8.1" "import guidellm" ;;
  *) echo "usage: $0 [aiperf|guidellm|all]" >&2; exit 2 ;;
esac
