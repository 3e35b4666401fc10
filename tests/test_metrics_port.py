"""tandem/metrics_port.py: a service's own metrics port answers Prometheus 2.x's scrape (an OpenMetrics Accept) in the
text format with the ``tandem:`` names whole, as prometheus_client's text parser reads them."""

from __future__ import annotations

import socket

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from tandem import metrics_port

# what Prometheus 2.x sends by default
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_prometheus_scrape_reads_every_colon_named_family_whole():
    registry = CollectorRegistry()
    Counter("tandem:drafter_rounds", "Rounds", ["kind"], registry=registry).labels("direct").inc(3)
    Gauge("tandem:num_requests_running", "Running", registry=registry).set(2)
    port = _free_port()
    server = metrics_port.serve(registry, port)
    try:
        for headers in ({"Accept": PROMETHEUS_ACCEPT}, {}):
            r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers, timeout=10)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain;")  # (as the gateway's)
            families = list(text_string_to_metric_families(r.text))
            # every family with its samples under its own (colon) name: none split off with an escaped one
            assert families and all(f.name.startswith("tandem:") and f.samples for f in families), r.text
            samples = {(s.name, tuple(s.labels.items())): s.value for f in families for s in f.samples}
            assert samples[("tandem:drafter_rounds_total", (("kind", "direct"),))] == 3.0
            assert samples[("tandem:num_requests_running", ())] == 2.0
    finally:
        server.shutdown()
        server.server_close()
