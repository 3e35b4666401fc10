"""Triton's installation hash started early (tandem/kernels/triton_start.py): computed in its own thread, then found
cached by Triton's lookup."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("triton")

from triton.runtime.cache import triton_key  # noqa: E402

from tandem.kernels import triton_start  # noqa: E402


def _hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "triton-key"]


def test_the_hash_is_made_in_a_thread_and_cached(monkeypatch):
    triton_key.cache_clear()
    monkeypatch.setattr(triton_start, "EARLY", False)
    triton_start.hash_triton_early()
    assert not _hash_threads() and triton_key.cache_info().currsize == 0
    monkeypatch.setattr(triton_start, "EARLY", True)
    triton_start.hash_triton_early()
    for thread in _hash_threads():
        thread.join(timeout=60)
    assert triton_key.cache_info().currsize == 1
    hits = triton_key.cache_info().hits
    triton_key()  # Triton's own first lookup now
    assert triton_key.cache_info().hits == hits + 1
