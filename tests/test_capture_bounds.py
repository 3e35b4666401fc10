"""Served-traffic capture stays bounded: each request keeps only its own feature rows (not the step's
whole host buffer), and the size cap counts the shards already in the folder (a restart does not
reset it)."""

from __future__ import annotations

import torch

from tandem.traffic.recorder import CaptureConfig, TrafficRecorder
from test_traffic_recorder import MANIFEST, finish_one


def test_a_request_keeps_only_its_own_rows_of_a_batch_step(tmp_path):
    rec = TrafficRecorder(CaptureConfig(str(tmp_path)), MANIFEST)
    try:
        batch = 64
        feats = torch.randn(batch, 6)
        rec.observe(feats, [(f"r{i}", 0, [i]) for i in range(batch)])  # one decode row per request
        held = rec._rows["r5"][0]
        assert torch.equal(held, feats[5:6])
        row_bytes = 6 * feats.element_size()
        assert held.untyped_storage().nbytes() == row_bytes  # not the step's 64 rows
        total = sum(t.untyped_storage().nbytes() for chunks in rec._rows.values() for t in chunks.values())
        assert total == batch * row_bytes
    finally:
        rec.close()


def test_the_size_cap_counts_what_is_on_disk_at_start(tmp_path):
    rec = TrafficRecorder(CaptureConfig(str(tmp_path), shard_samples=1), MANIFEST)
    finish_one(rec, "a", [1, 2, 3], [4, 5])
    rec.close()
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("shard-*.safetensors"))
    assert rec.samples_written == 1 and on_disk > 0
    # A restarted verifier with a cap the folder already exceeds writes nothing more.
    rec = TrafficRecorder(CaptureConfig(str(tmp_path), max_gb=on_disk / 2 / 1e9, shard_samples=1), MANIFEST)
    assert rec.bytes_written == on_disk
    finish_one(rec, "b", [1, 2, 3], [4, 5])
    rec.close()
    assert rec.samples_written == 0 and rec.samples_dropped == 1
    assert len(list(tmp_path.glob("shard-*.safetensors"))) == 1
    # Room left under the cap: it writes on.
    rec = TrafficRecorder(CaptureConfig(str(tmp_path), max_gb=on_disk * 10 / 1e9, shard_samples=1), MANIFEST)
    finish_one(rec, "c", [1, 2, 3], [4, 5])
    rec.close()
    assert rec.samples_written == 1
