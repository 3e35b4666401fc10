"""The verifier's and the drafter's metrics inside the gateway's ``/metrics``: the stack's one public metrics
URL then shows speculation (``tandem:spec_decode_*``, ``tandem:drafter_*``, KV pages) and the drafter
service's own (``tandem:drafter_served_*``, its prefix cache) under their own names, in one scrape.

Each service's text is fetched from its URL (``--verifier-metrics-url``, ``--drafter-metrics-url``) with a
short timeout, parsed and re-rendered. Families the gateway has itself (request counts, latencies, tokens:
the same names with a ``model_name`` label) are the gateway's view and a service's copy is dropped, so no
name appears twice. ``tandem:verifier_metrics_up`` / ``tandem:drafter_metrics_up`` say whether a service's
part is there. Scrapes within ``_CACHE_S`` share one fetch, so a flood of scrapes is not relayed; a service that did
not answer is asked again only ``_RETRY_S`` later, so a hung one does not hold every scrape for its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("gateway.metrics")

_CACHE_S = 1.0
_RETRY_S = 5.0
_MAX_BYTES = 16 << 20


class MetricsRelay:
    def __init__(self, service: str, url: str, timeout_s: float, own_names: set[str]):
        self.service, self.url = service, url
        self._timeout = timeout_s
        self._own = own_names
        self._lock = asyncio.Lock()
        self._cached: tuple[float, bytes | None] = (-1e9, None)

    async def fetch(self) -> bytes | None:
        """The service's families as exposition text, or None when it did not answer in time."""
        async with self._lock:
            at, text = self._cached
            if time.monotonic() - at < (_CACHE_S if text is not None else _RETRY_S):
                return text
            try:
                raw = await asyncio.wait_for(asyncio.to_thread(self._get), self._timeout + 0.5)
                text = self._filter(raw.decode("utf-8"))
            except Exception as e:  # unreachable, slow, or not Prometheus text: ours alone, said by the gauge
                log.warning("%s metrics at %s unavailable: %s", self.service, self.url, e)
                text = None
            self._cached = (time.monotonic(), text)
            return text

    def _get(self) -> bytes:
        with urllib.request.urlopen(self.url, timeout=self._timeout) as r:
            return r.read(_MAX_BYTES)

    def _filter(self, text: str) -> bytes:
        # (the text parser reads a counter's or histogram's ``<name>_created`` samples as a gauge family of their own:
        # kept, they carried the service's start time beside the gateway's own counts)
        families = [f for f in text_string_to_metric_families(text)
                    if f.name not in self._own and f.name.removesuffix("_created") not in self._own]
        return prometheus_client.generate_latest(_Families(families))


class _Families:
    """What ``generate_latest`` needs of a registry."""

    def __init__(self, families):
        self._families = families

    def collect(self):
        return iter(self._families)
