#!/usr/bin/env bash
# Build (once) a venv with NVIDIA NIXL (PyPI nixl + nixl-cu13 1.5.1, UCX backend) beside the
# project's own environment, outside any clone: ${MMSERVE_CACHE_DIR:-~/.cache/mmserve}/nixl-venv.
# It sees the project's packages (--system-site-packages: torch, numpy, mmserve). NIXL is a
# transfer library checked against our hand-over transport (benchmarks/transfer_libs.py), not a
# dependency. The nixl meta package asks for nixl-cu12 and nixl-cu13 both; the cu13 build alone
# runs here, without a GPU (docs/disagg.md). Idempotent: a stamp skips everything when it imports.
# Usage: bash scripts/nixl_venv.sh   (prints the venv's python on the last line)
set -euo pipefail
NIXL_VERSION=1.5.1
CACHE=${MMSERVE_CACHE_DIR:-$HOME/.cache/mmserve}
VENV="$CACHE/nixl-venv"
PY=${PYTHON:-python3}
stamp="$VENV/.mmserve-nixl-$NIXL_VERSION"
if [ -f "$stamp" ] && "$VENV/bin/python" -c "import nixl._api" 2>/dev/null; then
  echo "$VENV/bin/python"
  exit 0
fi
mkdir -p "$CACHE"
exec 9>"$CACHE/nixl-venv.lock"
flock 9
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
  "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION" >&2
"$VENV/bin/python" -c "import nixl._api" >&2
touch "$stamp"
echo "$VENV/bin/python"
