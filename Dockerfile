# mmserve image: one image, three services (command picks: mmserve encoder|llm|gateway).
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends ffmpeg \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY gateway ./gateway
COPY encoder_svc ./encoder_svc
COPY llm_svc ./llm_svc
COPY mmserve ./mmserve
COPY benchmarks ./benchmarks
RUN pip install --no-cache-dir .

ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
EXPOSE 8000 8100 8200
CMD ["mmserve", "gateway"]
