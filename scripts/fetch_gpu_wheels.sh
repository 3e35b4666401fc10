#!/usr/bin/env bash
# The wheels the lent GPU machine lacks (Python 3.12; no network there), downloaded here into .whl/ for
# scripts/gpu_check.sh to install: the services' web and tracing stack, gRPC health/reflection at the GPU's
# grpcio 1.84, FlashInfer, compressed-tensors for the quantized GPU tests, and py-spy
# (bench: TANDEM_BENCH_PYSPY samples the verifier's threads during each REST load). .whl/ is not tracked.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
cd .whl
pip download -q --only-binary=:all: --python-version 3.12 --no-deps \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2010_x86_64 \
  fastapi starlette pydantic pydantic-core uvicorn h11 click anyio sniffio idna annotated-types typing-inspection \
  typing-extensions importlib-metadata zipp opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common opentelemetry-proto \
  grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 flashinfer-python==0.6.1 apache-tvm-ffi==0.1.15.post2 \
  compressed-tensors loguru psutil py-spy
ls
