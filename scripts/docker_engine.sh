#!/usr/bin/env bash
# Install and start a Docker engine when none answers (root, Debian): docker.io and Debian's
# docker-compose (v1), with the two daemon settings these VMs need (../shared/ENV.md,
# "Containers"): default ulimits at the machine's own, and cgroupfs.
set -euo pipefail
docker info >/dev/null 2>&1 && exit 0
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap >/dev/null
fi
if [ ! -f /etc/docker/daemon.json ]; then
  mkdir -p /etc/docker
  cat > /etc/docker/daemon.json <<J
{"default-ulimits": {"nofile": {"Name": "nofile", "Soft": $(ulimit -Hn), "Hard": $(ulimit -Hn)},
                     "nproc": {"Name": "nproc", "Soft": 4096, "Hard": 4096}},
 "exec-opts": ["native.cgroupdriver=cgroupfs"]}
J
fi
setsid dockerd >/var/log/mmserve-dockerd.log 2>&1 < /dev/null &
for _ in $(seq 60); do docker info >/dev/null 2>&1 && exit 0; sleep 1; done
echo "dockerd did not start: /var/log/mmserve-dockerd.log" >&2
exit 1
