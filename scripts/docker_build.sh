#!/usr/bin/env bash
# Build the mmserve image here, offline: the local base images (scripts/docker_base.sh), the
# wheelhouse (scripts/wheelhouse.sh, cached in ~/.cache/mmserve/wheelhouse), then `docker build`
# with --no-index installs. What CI and tests/e2e/test_compose_stack.py run; Docker's layer
# cache makes a second build with unchanged sources take seconds.
#   bash scripts/docker_build.sh [TAG]      (default mmserve:latest; CUDA=1 keeps the CUDA wheels)
# Prints the build's wall time in seconds on its last line: {"build_s": ..., "image": ...}.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-mmserve:latest}
CUDA=${CUDA:-0}
if ! docker info >/dev/null 2>&1; then bash scripts/docker_engine.sh; fi
read -r BASE REDIS < <(bash scripts/docker_base.sh)
WHEELS=$(CUDA=$CUDA bash scripts/wheelhouse.sh "${MMSERVE_CACHE_DIR:-$HOME/.cache/mmserve}/wheelhouse-cuda$CUDA")
# the build context's ./wheelhouse: hard links (no copy) when on one filesystem
find wheelhouse -name '*.whl' -delete
cp -l "$WHEELS"/*.whl wheelhouse/ 2>/dev/null || cp "$WHEELS"/*.whl wheelhouse/
t0=$(date +%s.%N)
docker build -q --build-arg BASE_IMAGE="$BASE" --build-arg CUDA="$CUDA" -t "$TAG" . >/dev/null
t1=$(date +%s.%N)
find wheelhouse -name '*.whl' -delete
python3 -c "import json,sys; print(json.dumps({'build_s': round($t1 - $t0, 1), 'image': sys.argv[1], 'base': sys.argv[2], 'redis_image': sys.argv[3]}))" "$TAG" "$BASE" "$REDIS"
