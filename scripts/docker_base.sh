#!/usr/bin/env bash
# Local base images for machines that reach Debian's packages and PyPI but no image registry
# (docs/deployment.md, "Building offline"):
#   mmserve-base:bookworm   debootstrap --variant=minbase bookworm (Python 3.11), imported as is
#   mmserve-redis:bookworm  that base plus Debian's redis-server (stands in for redis:7-alpine)
# Each is built only when missing (FORCE=1 rebuilds). Needs root, debootstrap and a Docker engine.
#   bash scripts/docker_base.sh && docker build --build-arg BASE_IMAGE=mmserve-base:bookworm ...
set -euo pipefail
BASE=${MMSERVE_BASE_IMAGE:-mmserve-base:bookworm}
REDIS=${MMSERVE_REDIS_IMAGE:-mmserve-redis:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
have() { [ "${FORCE:-0}" != 1 ] && docker image inspect "$1" >/dev/null 2>&1; }

if ! have "$BASE"; then
  dir=$(mktemp -d /var/tmp/mmserve-base.XXXXXX)
  trap 'rm -rf "$dir"' EXIT
  echo "[docker_base] debootstrap bookworm -> $BASE" >&2
  debootstrap --variant=minbase bookworm "$dir" "$MIRROR" >/dev/null
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar -C "$dir" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    -c 'CMD ["bash"]' - "$BASE" >/dev/null
fi

if ! have "$REDIS"; then
  echo "[docker_base] $REDIS from $BASE" >&2
  docker build -q -t "$REDIS" - >/dev/null <<DOCKERFILE
FROM $BASE
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]
DOCKERFILE
fi
echo "$BASE $REDIS"
