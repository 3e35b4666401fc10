# One image for the three services; each compose service runs a different `python -m` entry point.
# docker-compose.yml builds it for NVIDIA GPUs (its defaults):
#   --build-arg BASE=nvidia/cuda:12.8.1-devel-ubuntu24.04 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
#   --build-arg EXTRAS=gpu
# The devel image has nvcc, which FlashInfer's kernels compile with on first use; gcc and the Python headers
# are what Triton compiles its kernel launchers with. Without build args: a CPU image (python:3.11-slim).
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
# The demo pair ships inside the package; a pair rebuilt in the container goes to TANDEM_CACHE, not onto
# the model volume, which compose mounts read-only.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TANDEM_CACHE=/opt/tandem/cache
RUN if [ -n "${EXTRAS}" ] || ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-dev gcc \
      && rm -rf /var/lib/apt/lists/*; fi \
 && (python3 -m pip install --break-system-packages "torch>=2.4,<2.14" --index-url ${TORCH_INDEX} 2>/dev/null \
     || python3 -m pip install "torch>=2.4,<2.14" --index-url ${TORCH_INDEX})
WORKDIR /app
COPY pyproject.toml README.md ./
COPY tandem tandem
COPY verifier verifier
COPY drafter drafter
COPY gateway gateway
COPY proto proto
RUN SPEC=".${EXTRAS:+[${EXTRAS}]}" \
 && (python3 -m pip install --break-system-packages "${SPEC}" 2>/dev/null || python3 -m pip install "${SPEC}") \
 && python3 -c "from tandem.training.demo import ensure_demo_draft; print(ensure_demo_draft())" \
 && mkdir -p /opt/tandem/cache && chmod -R a+rX /opt/tandem
# The services run as an unprivileged user that cannot write the code or the demo pair.
# (heads published as pytorch_model.bin are converted into TANDEM_CACHE/converted: the one folder there it writes)
RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin tandem \
 && mkdir -p /var/cache/tandem-compile && chown tandem /var/cache/tandem-compile \
 && mkdir -p /opt/tandem/cache/converted && chown tandem /opt/tandem/cache/converted
USER tandem
