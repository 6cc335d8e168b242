#!/usr/bin/env bash
# Quickstart, command 1: install what is missing, then run the whole stack locally
# (gateway + one encoder + one LLM service) on the default tiny model, embedded cache, no Redis.
# Extra arguments go to `mmserve up` (e.g. --port 8080 --encoders 2 --backend swa).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m mmserve.cli up "$@"
