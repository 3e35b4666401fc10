"""Free ports for services started side by side (tandem.service_probe.free_ports)."""

from __future__ import annotations

import socket

from tandem.service_probe import PORT_RANGE_ENV, _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_clear_of_the_ephemeral_range():
    """Outgoing connections take their local ports from the kernel's ephemeral range: a service port picked there
    (binding port 0) was taken by a client before the service bound it. Picked ports lie below it, distinct, and
    can be bound."""
    low = _ephemeral_low()
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(p < low for p in ports) or low - 20000 <= 1000, (ports, low)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_given_port_range_narrows_the_pick(monkeypatch):
    """The tests give each pytest-xdist worker its own range (tests/conftest.py): a drafter killed and started again at
    its address found its port taken meanwhile by the other worker's service."""
    monkeypatch.setenv(PORT_RANGE_ENV, "23000-25000")
    ports = free_ports(16)
    assert len(set(ports)) == 16 and all(23000 <= p < 25000 for p in ports), ports
