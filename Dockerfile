# CPU image by default:
#   docker build -t localserve .
# CUDA image: a CUDA base and the matching PyTorch wheel index:
#   docker build -t localserve:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# A fleet's replica (PostgreSQL store, docs/fleet.md): --build-arg EXTRAS=fleet
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 \
    LOCALSERVE_HOME=/data \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# CUDA bases ship without Python; python:* bases already have it. gcc: the CPU kernels
# (server/kernels/*.c) are compiled on first use for the CPU they
# run on; without a compiler PyTorch's kernels run instead, several times slower.
RUN apt-get update \
    && (command -v python3 >/dev/null \
        || apt-get install -y --no-install-recommends python3 python3-venv python3-pip) \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /app
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX_URL} torch
COPY pyproject.toml README.md ./
COPY server ./server
COPY cli ./cli
COPY storage ./storage
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"

VOLUME /data
EXPOSE 8000
ENTRYPOINT ["localserve"]
CMD ["run", "smollm2-135m", "Name the capital of France."]
