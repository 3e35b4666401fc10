"""TrafficRecorder on its own: samples assembled by position, shards numbered after the highest
existing one, and a writer that fails (the folder vanished, a full disk) stops capture without
blocking the engine or the shutdown."""

from __future__ import annotations

import shutil
import time

import torch

from tandem.traffic.dataset import TrafficManifest, read_features, read_index
from tandem.traffic.recorder import CaptureConfig, TrafficRecorder

MANIFEST = TrafficManifest(target_model="t", hidden_size=2, vocab_size=50, capture_layers=(1, 2, 3), feature_width=6,
                           dtype="float32")


def finish_one(rec: TrafficRecorder, rid: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Observe a prefill of the prompt and one plain step per output token but the last; → the features."""
    n = len(prompt) + len(output) - 1
    feats = torch.arange(n * 6, dtype=torch.float32).view(n, 6) + 1000 * len(prompt)
    rec.observe(feats, [(rid, 0, list(range(len(prompt))))])
    for pos in range(len(prompt), n):
        rec.observe(feats, [(rid, pos, [pos])])
    rec.finished(rid, prompt, output, {"temperature": 0.0})
    return feats


def test_samples_are_assembled_and_numbered_after_existing_shards(tmp_path):
    rec = TrafficRecorder(CaptureConfig(str(tmp_path), shard_samples=1), MANIFEST)
    a = finish_one(rec, "a", [1, 2, 3], [4, 5])
    rec.discard("gone")
    rec.close()
    (tmp_path / "shard-000000.safetensors").rename(tmp_path / "shard-000007.safetensors")  # a gap before it
    rec = TrafficRecorder(CaptureConfig(str(tmp_path), shard_samples=1), MANIFEST)
    b = finish_one(rec, "b", [9, 8], [7, 6, 5])
    rec.close()
    index = read_index(tmp_path)
    assert [(tokens, plen) for _, tokens, plen, _ in index] == [([1, 2, 3, 4, 5], 3), ([9, 8, 7, 6, 5], 2)]
    assert [ref.shard.rsplit("/", 1)[1] for ref, _, _, _ in index] == ["shard-000007.safetensors",
                                                                       "shard-000008.safetensors"]
    assert torch.equal(read_features(index[0][0]), a) and torch.equal(read_features(index[1][0]), b)


def test_a_failing_writer_stops_capture_without_blocking(tmp_path):
    folder = tmp_path / "traffic"
    rec = TrafficRecorder(CaptureConfig(str(folder), shard_samples=1), MANIFEST)
    shutil.rmtree(folder)  # every later write fails
    finish_one(rec, "a", [1, 2], [3])
    deadline = time.monotonic() + 10
    while not rec._failed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rec._failed
    for i in range(50):  # the engine keeps finishing requests: nothing blocks, everything is counted
        finish_one(rec, f"r{i}", [1, 2], [3])
    started = time.monotonic()
    rec.close()
    assert time.monotonic() - started < 5
    assert rec.samples_written == 0 and rec.samples_dropped == 51


def test_a_short_shard_reaches_the_disk_once_its_first_sample_is_shard_age_s_old(tmp_path):
    """Light traffic is not held until 256 samples or a clean stop (a verifier killed outright would lose it): the
    shard closes short after shard_age_s; the samples after it start the next one."""
    rec = TrafficRecorder(CaptureConfig(str(tmp_path), shard_age_s=0.5), MANIFEST)
    try:
        finish_one(rec, "a", [1, 2, 3], [4, 5])
        finish_one(rec, "b", [9, 8], [7])
        time.sleep(0.2)
        assert read_index(tmp_path) == []  # (younger than shard_age_s: still one shard being filled)
        deadline = time.monotonic() + 10
        while not read_index(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [tokens for _, tokens, _, _ in read_index(tmp_path)] == [[1, 2, 3, 4, 5], [9, 8, 7]]
        finish_one(rec, "c", [6, 6], [6])
    finally:
        rec.close()
    index = read_index(tmp_path)
    assert [tokens for _, tokens, _, _ in index] == [[1, 2, 3, 4, 5], [9, 8, 7], [6, 6, 6]]
    assert len({ref.shard for ref, _, _, _ in index}) == 2 and rec.samples_written == 3
