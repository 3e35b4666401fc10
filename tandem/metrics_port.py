"""A service's own Prometheus port (the verifier's and the drafter's ``--metrics-port``): the text format 0.0.4, whatever
the scraper's Accept header asks. prometheus_client's ``start_http_server`` answers Prometheus 2.x's OpenMetrics
Accept with names escaped to underscores in the samples but not in their ``# HELP`` / ``# TYPE`` lines (0.26), so each
``tandem:`` family parsed as two; the plain text keeps the colon names (vLLM's, which its dashboards read) whole, and
every Prometheus reads it (the content type the gateway's ``/metrics`` sends)."""

from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # (a scrape in flight never holds the service's exit)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # (a scrape every few seconds is not news)
        pass


def serve(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> WSGIServer:
    """Serve ``registry`` on ``host:port`` from a daemon thread (any path); OSError where the port is taken."""
    def app(environ, start_response):
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body]

    server = make_server(host, port, app, _Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True).start()
    return server
