# mmserve image: one image, three services (the command picks: mmserve encoder|llm|gateway).
#
# Two stages on one base (BASE_IMAGE; its public default, python:3.11-slim, is pinned by digest in
# docs/deployment.md; any Debian-based image with Python 3.11 or apt works, e.g. a debootstrap
# bookworm made by scripts/docker_base.sh where no registry is reachable):
#   build    C compiler; the dependencies from requirements.lock (hash-checked, no resolver) into
#            /opt/venv, from a wheelhouse (--no-index: the offline build; WHEELHOUSE_URL, or
#            ./wheelhouse when it holds wheels: scripts/wheelhouse.sh) or else from the index
#            (the CUDA build of torch: it needs the NVIDIA wheels even on the CPU); every C kernel compiled for the
#            x86-64 levels v2, v3 and v4 into /opt/mmserve/kernels
#   runtime  no compiler: Python, ffmpeg, tcmalloc, the venv and the kernels; a non-root user;
#            writable paths only under /var/cache/mmserve (kernel builds, the tiny model)
# The LLM service loads the highest kernel level the CPU runs (MMSERVE_KERNEL_PREBUILT); a
# -march=native build needs a compiler at start: NATIVE_KERNELS=1 adds gcc to the runtime stage
# and the services then build native kernels into $MMSERVE_CACHE_DIR (a volume) on first use.
# /readyz and /metrics of the LLM service say which kernels loaded and which fell back.
#
#   bash scripts/docker_build.sh                       # what CI runs (offline, local base)
#   docker build -t mmserve:latest .                   # anywhere with registry and PyPI access
# Written for the classic builder and BuildKit alike (no RUN --mount): docker-compose v1 builds it.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! command -v python3.11 >/dev/null; then \
         apt-get install -y --no-install-recommends python3.11 python3.11-venv; fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# declared here, not above: a build argument is part of the cache key of every later RUN
ARG CUDA=1
# a wheelhouse served over HTTP (scripts/docker_build.sh serves one on the docker bridge): the
# build context stays small and this layer stays cached while requirements.lock is unchanged
ARG WHEELHOUSE_URL=
COPY requirements.lock scripts/lock_filter.sh /tmp/lock/
COPY wheelhouse/ /wheelhouse/
RUN sh /tmp/lock/lock_filter.sh "$CUDA" < /tmp/lock/requirements.lock > /tmp/lock/requirements.txt \
    && if [ -n "$WHEELHOUSE_URL" ]; then \
         host=${WHEELHOUSE_URL#*://}; host=${host%%[:/]*}; [ -n "$host" ] || exit 1; \
         from="--no-index --find-links $WHEELHOUSE_URL --trusted-host $host"; \
       elif ls /wheelhouse/*.whl >/dev/null 2>&1; then from="--no-index --find-links /wheelhouse"; \
       else from=""; fi \
    && pip install --no-deps --require-hashes $from -r /tmp/lock/requirements.txt \
    && rm -rf /wheelhouse
COPY pyproject.toml README.md /src/
COPY shared /src/shared
COPY gateway /src/gateway
COPY encoder_svc /src/encoder_svc
COPY llm_svc /src/llm_svc
COPY mmserve /src/mmserve
COPY benchmarks /src/benchmarks
# the package under its own prefix, merged into the venv in the runtime stage: a change of the
# sources then rebuilds a few MB, while the venv's GBs of dependencies stay one cached layer
RUN pip install --no-deps --no-build-isolation --prefix /opt/app /src \
    && PYTHONPATH=/opt/app/lib/python3.11/site-packages MMSERVE_CACHE_DIR=/tmp/kernel-scratch \
       python -m llm_svc.kernels.prebuild --out /opt/mmserve/kernels \
    && rm -rf /tmp/kernel-scratch

FROM ${BASE_IMAGE} AS runtime
ARG NATIVE_KERNELS=0
ENV DEBIAN_FRONTEND=noninteractive
RUN set -e; apt-get update; \
    tcmalloc=libtcmalloc-minimal4; apt-cache show "$tcmalloc" >/dev/null 2>&1 || tcmalloc=libtcmalloc-minimal4t64; \
    apt-get install -y --no-install-recommends ffmpeg "$tcmalloc"; \
    if ! command -v python3.11 >/dev/null; then apt-get install -y --no-install-recommends python3.11; fi; \
    if [ "$NATIVE_KERNELS" = 1 ]; then apt-get install -y --no-install-recommends gcc libc6-dev; fi; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --system --uid 10001 --user-group --home-dir /var/cache/mmserve --no-create-home mmserve; \
    mkdir -p /var/cache/mmserve/kernels /models; \
    chown -R mmserve:mmserve /var/cache/mmserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/app/ /opt/venv/
COPY --from=build /opt/mmserve/kernels /opt/mmserve/kernels
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/var/cache/mmserve \
    MMSERVE_CACHE_DIR=/var/cache/mmserve \
    MMSERVE_KERNEL_PREBUILT=/opt/mmserve/kernels \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TMPDIR=/tmp
USER 10001:10001
WORKDIR /var/cache/mmserve
EXPOSE 8000 8100 8200
CMD ["mmserve", "gateway"]
