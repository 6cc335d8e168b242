#!/usr/bin/env bash
# Quickstart, command 2: install what is missing (package + test extras, ffmpeg, Redis),
# make sure Redis runs on 127.0.0.1:6379, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
PY=${PYTHON:-python3}
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "[test] starting redis-server on 127.0.0.1:6379" >&2
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
  for _ in $(seq 50); do redis-cli -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
bash scripts/vllm_venv.sh >/dev/null  # the vLLM oracle's venv (tests marked vllm); cached, fast when built
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m pytest -q -p no:cacheprovider tests "$@"
