# One image for the three services; each compose service runs a different `python -m` entry point.
# CPU by default; for NVIDIA GPUs build with
#   --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The demo pair is built into the image (below), not onto the model volume, which compose mounts read-only.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TANDEM_CACHE=/opt/tandem/cache
RUN (command -v python3 >/dev/null || (apt-get update && apt-get install -y --no-install-recommends python3 python3-pip && rm -rf /var/lib/apt/lists/*)) \
 && python3 -m pip install --break-system-packages "torch>=2.4,<2.14" --index-url ${TORCH_INDEX} 2>/dev/null \
 || python3 -m pip install "torch>=2.4,<2.14" --index-url ${TORCH_INDEX}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY tandem tandem
COPY verifier verifier
COPY drafter drafter
COPY gateway gateway
COPY proto proto
RUN python3 -m pip install --break-system-packages . 2>/dev/null || python3 -m pip install .
# Build the embedded demo pair into the image so containers start without training anything.
RUN python3 -c "from tandem.demo import ensure_demo_draft; ensure_demo_draft()" && chmod -R a+rX /opt/tandem
# The services run as an unprivileged user that cannot write the code or the demo pair.
RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin tandem
USER tandem
