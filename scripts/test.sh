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
if [ "$#" -gt 0 ]; then  # a selection of one's own: exactly that
  exec "$PY" -m pytest -q -p no:cacheprovider tests "$@"
fi
# The whole suite. The benchmark smoke step (every benchmark at its tiniest, mostly child
# processes starting up and waiting on each other) runs beside the rest, not after it: the rest
# leaves the second core idle much of the time. Its output follows the rest's.
SMOKE_LOG=$(mktemp /tmp/mmserve-smoke.XXXXXX.log)
"$PY" -m pytest -q -p no:cacheprovider tests/integration/test_bench_smoke.py >"$SMOKE_LOG" 2>&1 &
SMOKE_PID=$!
set +e
"$PY" -m pytest -q -p no:cacheprovider tests --ignore=tests/integration/test_bench_smoke.py
REST=$?
wait "$SMOKE_PID"
SMOKE=$?
set -e
echo "---- benchmark smoke step (tests/integration/test_bench_smoke.py) ----"
cat "$SMOKE_LOG"
rm -f "$SMOKE_LOG"
[ "$REST" -eq 0 ] && [ "$SMOKE" -eq 0 ]
