#!/bin/sh
# requirements.lock on stdin -> stdout; with argument 0, without the NVIDIA, CUDA and Triton
# wheels (torch's CUDA build imports and runs on the CPU without them: a 3 GB smaller image).
if [ "${1:-1}" = 1 ]; then exec cat; fi
exec awk '/^[A-Za-z0-9]/ { skip = ($0 ~ /^(nvidia-|cuda-|triton==)/) } !skip'
