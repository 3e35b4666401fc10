"""OpenTelemetry set-up and W3C trace-context propagation, shared by gateway, verifier and drafter.

One call per process, from each service's ``__main__``: ``setup_tracing(service_name, endpoint)``.
Spans then travel across the gRPC hops as a W3C ``traceparent`` in the call metadata
(``inject_metadata`` on the client, ``extract_context`` on the server), or in a proto
``map<string, string>`` (``inject_dict`` / ``extract``) where there is no metadata (a control
message on a long-lived stream).

Torch-free, and importable without opentelemetry (the GPU machine may not have it): every helper
then degrades to a no-op, and so does everything when no endpoint or exporter is configured (the
API's default provider hands out non-recording spans, which cost next to nothing). We do not use
the opentelemetry-instrumentation packages: they are not installed everywhere, and their stream
spans end only when a stream is fully read (ecosystem.md §3), which cancelled streams never are.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from tandem.log_limit import RepeatFilter

log = logging.getLogger("tandem.tracing")

try:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    OTEL_AVAILABLE = True
    # W3C trace context only: it is what every service extracts, whatever OTEL_PROPAGATORS says.
    _PROPAGATOR = TraceContextTextMapPropagator()
    _KINDS = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
except ImportError:  # pragma: no cover - exercised on machines without opentelemetry
    OTEL_AVAILABLE = False
    Context = Any  # type: ignore[misc,assignment]

ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("grpc", "http/protobuf")  # (the standard's http/json has no Python exporter)
# The OpenTelemetry loggers that say a line per failed export (the OTLP exporter's retries, the batch processor's)
EXPORT_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter", "opentelemetry.exporter.otlp.proto.http",
                  "opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.sdk._shared_internal",
                  "opentelemetry.sdk.trace.export")


def setup_tracing(service_name: str, otlp_endpoint: str | None = None, exporter: Any = None):
    """Install the process-wide TracerProvider and return it, or return None (tracing off).

    - ``exporter`` given (tests: an ``InMemorySpanExporter``): spans go to it synchronously.
    - else an OTLP endpoint, from ``otlp_endpoint`` or the standard ``OTEL_EXPORTER_OTLP_*``
      variables: spans are batched to it in the background, over gRPC or, where
      ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` says ``http/protobuf``, over HTTP (an endpoint without a path
      posts to ``/v1/traces``, as the standard's base URL does).
    - else nothing is installed and spans are non-recording.

    OpenTelemetry allows one global provider per process; a second call adds its exporter to the
    provider already installed (tests and in-process stacks call this more than once).
    """
    if not OTEL_AVAILABLE:
        if otlp_endpoint or exporter is not None:
            log.warning("tracing requested but opentelemetry is not installed; spans are not recorded")
        return None
    endpoint = otlp_endpoint or next((os.environ[k] for k in ENDPOINT_ENV if os.environ.get(k)), None)
    if exporter is None and not endpoint:
        return None

    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        if exporter is not None:
            processor = SimpleSpanProcessor(exporter)
        else:
            protocol = next((os.environ[k].strip() for k in PROTOCOL_ENV if os.environ.get(k)), "grpc")
            if protocol not in PROTOCOLS:
                log.warning("tracing: OTLP protocol %r is not one of %s; spans are not recorded", protocol,
                            ", ".join(PROTOCOLS))
                return None
            processor = BatchSpanProcessor(_otlp_exporter(protocol, endpoint))
            for name in EXPORT_LOGGERS:  # (a collector down: a line per failed export, from every service)
                logger = logging.getLogger(name)
                if not any(isinstance(f, RepeatFilter) for f in logger.filters):
                    logger.addFilter(RepeatFilter())
    except ImportError as e:  # the API without the SDK or the OTLP exporter
        log.warning("tracing requested but %s is missing; spans are not recorded", e.name)
        return None

    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        current.add_span_processor(processor)
        return current
    # (the standard variables name the service where they say one: Resource.create lets given attributes win)
    resource = Resource.create({} if _named_by_environment() else {"service.name": service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    log.info("tracing %s to %s", resource.attributes.get("service.name"), endpoint or type(exporter).__name__)
    return provider


def _otlp_exporter(protocol: str, endpoint: str):
    if protocol == "http/protobuf":
        from urllib.parse import urlsplit

        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

        if urlsplit(endpoint).path in ("", "/"):  # a base URL: the traces path after it, as the standard says
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HTTPExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    # insecure unless the URL says https: collectors beside the services speak plain gRPC.
    return OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))


def _named_by_environment() -> bool:
    """Whether OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names the service."""
    listed = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return bool(os.environ.get("OTEL_SERVICE_NAME")) or any(
        pair.partition("=")[0].strip() == "service.name" for pair in listed.split(","))


def shutdown_tracing() -> None:
    """Flush and stop the exporters (call at exit so the last batch is not lost)."""
    if OTEL_AVAILABLE:
        provider = trace.get_tracer_provider()
        if hasattr(provider, "shutdown"):
            provider.shutdown()


# ---- spans -------------------------------------------------------------------------------------


def start_span(name: str, parent: Context | None = None, kind: str = "internal",
               attributes: Mapping[str, Any] | None = None, tracer: str = "tandem"):
    """Start a span that the caller must ``end()``; it is not made current, so it can outlive the
    handler that started it (a streamed response ends long after its route function returned)."""
    if not OTEL_AVAILABLE:
        return _NOOP_SPAN
    return trace.get_tracer(tracer).start_span(name, context=parent, kind=_KINDS[kind],
                                               attributes=dict(attributes or {}))


def context_with(span) -> Context | None:
    """The context whose current span is ``span``: what to inject for calls made on its behalf."""
    return trace.set_span_in_context(span) if OTEL_AVAILABLE else None


@contextlib.contextmanager
def use_span(span):
    """Make ``span`` current inside the block without ending it on exit."""
    if not OTEL_AVAILABLE:
        yield span
        return
    with trace.use_span(span, end_on_exit=False):
        yield span


def set_error(span, message: str) -> None:
    if OTEL_AVAILABLE:
        span.set_status(Status(StatusCode.ERROR, message))


# gRPC codes that are the server's fault, by OpenTelemetry's RPC conventions: a server span ends in error on these alone
GRPC_SERVER_FAULTS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})


def end_refused_or_failed(span, message: str, server_fault: bool) -> None:
    """A server span's unsuccessful end, as OpenTelemetry's HTTP and RPC conventions mark it: in error where the server
    failed (5xx, GRPC_SERVER_FAULTS), else its status left unset (a client's bad request, a client gone: span-derived
    error rates would count them as the server's) with the reason in ``tandem.refused``."""
    if server_fault:
        set_error(span, message)
    else:
        span.set_attribute("tandem.refused", message)


def end_rpc_unsuccessful(span, code: str, message: str) -> None:
    """``end_refused_or_failed`` for a gRPC server span ended with status ``code`` (its name)."""
    end_refused_or_failed(span, message, server_fault=code in GRPC_SERVER_FAULTS)


def trace_id_hex(span) -> str:
    """The 32-hex-digit trace id of ``span`` (empty when not recording): for log lines."""
    if not OTEL_AVAILABLE or not span.get_span_context().is_valid:
        return ""
    return format(span.get_span_context().trace_id, "032x")


# ---- propagation -------------------------------------------------------------------------------


def inject_dict(context: Context | None = None) -> dict[str, str]:
    """W3C headers (``traceparent``, maybe ``tracestate``) of ``context`` or the current span;
    empty when there is nothing to propagate."""
    carrier: dict[str, str] = {}
    if OTEL_AVAILABLE:
        _PROPAGATOR.inject(carrier, context=context)
    return carrier


def inject_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """The same as gRPC call metadata: ``stub.Method(req, metadata=inject_metadata())``."""
    return list(inject_dict(context).items())


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The context carried by a ``traceparent`` mapping (a proto map, HTTP headers); None when absent."""
    if not OTEL_AVAILABLE or not carrier:
        return None
    return _PROPAGATOR.extract({k.lower(): v for k, v in carrier.items()})


def extract_context(metadata: Mapping[str, str] | Iterable[tuple[str, Any]] | None) -> Context | None:
    """The parent context for a server span, from gRPC metadata (``context.invocation_metadata()``,
    a sequence of key/value pairs) or any mapping such as HTTP headers; None when absent."""
    if metadata is None:
        return None
    if isinstance(metadata, Mapping):
        return extract(metadata)
    # gRPC metadata may repeat keys and carry binary (-bin) values; the first text value wins.
    carrier: dict[str, str] = {}
    for key, value in metadata:
        if isinstance(value, str):
            carrier.setdefault(key.lower(), value)
    return extract(carrier)


# ---- no-op stand-ins for machines without opentelemetry ----------------------------------------


class _NoopSpan:
    def set_attribute(self, key, value) -> None: ...
    def set_attributes(self, attributes) -> None: ...
    def add_event(self, name, attributes=None, timestamp=None) -> None: ...
    def record_exception(self, exception, attributes=None) -> None: ...
    def set_status(self, status, description=None) -> None: ...
    def end(self, end_time=None) -> None: ...
    def is_recording(self) -> bool:
        return False


_NOOP_SPAN = _NoopSpan()
