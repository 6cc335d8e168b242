#!/usr/bin/env bash
# Build the mmserve image here, offline: the local base images (scripts/docker_base.sh), the
# wheelhouse (scripts/wheelhouse.sh, cached in ~/.cache/mmserve/wheelhouse), then `docker build`
# with --no-index installs. What CI and tests/e2e/test_compose_stack.py run; Docker's layer
# cache makes a second build with unchanged sources take seconds.
#   bash scripts/docker_build.sh [TAG]      (default mmserve:latest;
#                                           NO_CACHE=1 rebuilds every layer)
# Prints the build's wall time in seconds on its last line: {"build_s": ..., "image": ...}.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-mmserve:latest}
CUDA=${CUDA:-1}
if ! docker info >/dev/null 2>&1; then bash scripts/docker_engine.sh; fi
read -r BASE REDIS < <(bash scripts/docker_base.sh)
WHEELS=$(CUDA=$CUDA bash scripts/wheelhouse.sh "${MMSERVE_CACHE_DIR:-$HOME/.cache/mmserve}/wheelhouse")
# the wheelhouse over HTTP on the docker bridge (the build's containers reach it; nothing else
# can): the build context stays small, and a fixed URL keeps the install layer cached
BRIDGE=$(ip -4 -o addr show docker0 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
[ -n "$BRIDGE" ] || { echo "no docker0 address: is the engine's default bridge up?" >&2; exit 1; }
PORT=${MMSERVE_WHEELHOUSE_PORT:-18765}
python3 -m http.server --bind "$BRIDGE" --directory "$WHEELS" "$PORT" >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 50); do python3 -c "import urllib.request as u; u.urlopen('http://$BRIDGE:$PORT/', timeout=1)" 2>/dev/null && break; sleep 0.1; done
t0=$(date +%s.%N)
docker build -q ${NO_CACHE:+--no-cache} --build-arg BASE_IMAGE="$BASE" --build-arg CUDA="$CUDA" \
  --build-arg WHEELHOUSE_URL="http://$BRIDGE:$PORT/" -t "$TAG" . >/dev/null
t1=$(date +%s.%N)
python3 -c "import json,sys; print(json.dumps({'build_s': round($t1 - $t0, 1), 'image': sys.argv[1], 'base': sys.argv[2], 'redis_image': sys.argv[3]}))" "$TAG" "$BASE" "$REDIS"
