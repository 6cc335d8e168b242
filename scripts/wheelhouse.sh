#!/usr/bin/env bash
# The image's offline wheelhouse: every wheel requirements.lock pins (hash-checked), downloaded
# once into DIR (default ~/.cache/mmserve/wheelhouse, outside the clone so CI reuses it).
#   bash scripts/wheelhouse.sh [DIR]           CUDA=0: without the NVIDIA / CUDA / Triton wheels
# The Dockerfile installs from it with --no-index --find-links (docs/deployment.md).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-${MMSERVE_CACHE_DIR:-$HOME/.cache/mmserve}/wheelhouse}
mkdir -p "$DIR"
lock=$(mktemp)
trap 'rm -f "$lock"' EXIT
bash scripts/lock_filter.sh "${CUDA:-1}" < requirements.lock > "$lock"
stamp="$DIR/.complete-$(sha256sum "$lock" | cut -c1-16)"  # this lock's wheels all there, checked
if [ -f "$stamp" ]; then echo "$DIR"; exit 0; fi
# for this machine's Python (3.11 on x86-64 Linux, as the image's)
python3 -m pip download -q --no-deps --require-hashes --only-binary=:all: -r "$lock" -d "$DIR"
touch "$stamp"
echo "$DIR"
