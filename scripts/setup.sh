#!/usr/bin/env bash
# Install what is missing for mmserve: system ffmpeg, then the package (editable) with its pins.
# Idempotent and quick when everything is there (a stamp of pyproject.toml skips pip).
# Usage: source-free; `bash scripts/setup.sh [--test]`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test,dali,nixl]"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi; }

if ! command -v ffmpeg >/dev/null 2>&1; then
  echo "[setup] installing ffmpeg" >&2
  as_root apt-get update -qq && as_root apt-get install -y -qq ffmpeg >/dev/null
fi
# tcmalloc for the engine core (core_malloc=auto preloads it, as vLLM's CPU docs recommend for
# theirs): optional, the core runs on glibc's malloc without it
if ! ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  echo "[setup] installing libtcmalloc-minimal4" >&2
  { as_root apt-get update -qq && as_root apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; } \
    || echo "[setup] libtcmalloc-minimal4 not installed; the engine core uses glibc's malloc" >&2
fi
if [ -n "$extras" ] && ! command -v redis-server >/dev/null 2>&1; then
  echo "[setup] installing redis-server" >&2
  as_root apt-get update -qq && as_root apt-get install -y -qq redis-server >/dev/null
fi

if [ -n "$extras" ] && ! command -v chromium >/dev/null 2>&1; then
  echo "[setup] installing chromium (the dashboard's e2e test)" >&2
  as_root apt-get update -qq && as_root apt-get install -y -qq chromium chromium-driver >/dev/null
fi

mkdir -p .mmserve
stamp=".mmserve/installed${extras}.stamp"
want=$( (cat pyproject.toml; "$PY" --version) | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$PY" -c "import mmserve.cli" 2>/dev/null; then
  echo "[setup] pip install -e .${extras}" >&2
  "$PY" -m pip install -q --disable-pip-version-check -e ".${extras}"
  echo "$want" > "$stamp"
fi
