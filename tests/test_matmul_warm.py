"""The capture's matrix products recorded, saved and replayed (tandem/matmul_warm.py), on the CPU."""

import json

import torch
import torch.nn.functional as F

from tandem import matmul_warm
from tandem.matmul_warm import MatmulShapes, MatmulWarm, replay, shapes_file


def _products():
    """Products as a model's forward runs them: a linear with bias on a 3-D input, one on a transposed weight's
    view (strides (1, K)), a slice at an offset, an einsum, a bmm; and an op that is not a product."""
    w = torch.randn(6, 8, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    F.linear(x, w, torch.zeros(6, dtype=torch.bfloat16))
    F.linear(x[0], torch.randn(8, 5, dtype=torch.bfloat16).t())
    big = torch.randn(4, 8)
    torch.mm(big[1:3], torch.randn(8, 2))
    torch.einsum("thd,hdk->thk", torch.randn(5, 2, 3), torch.randn(2, 3, 4))
    torch.bmm(torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    torch.relu(big)


def _recorded() -> MatmulShapes:
    with torch.inference_mode(), MatmulShapes() as shapes:
        _products()
        _products()  # a product run twice is recorded once
    return shapes


def test_records_each_product_once_by_op_and_layout():
    seen = list(_recorded().seen.values())
    ops = sorted(name for name, _, _ in seen)
    assert ops == sorted(["aten.linear.default"] * 2 + ["aten.mm.default", "aten.einsum.default", "aten.bmm.default"])
    (mm,) = [args for name, args, _ in seen if name == "aten.mm.default"]
    assert mm[0] == {"shape": [2, 8], "stride": [8, 1], "offset": 8, "dtype": "float32"}
    transposed = [args for name, args, _ in seen if name == "aten.linear.default" and len(args) == 2]
    assert transposed[0][1] == {"shape": [5, 8], "stride": [1, 5], "offset": 0, "dtype": "bfloat16"}


def test_replay_runs_the_same_products():
    """What a replay runs, recorded in turn, is what was recorded: the same ops on the same layouts."""
    first = _recorded()
    entries = json.loads(json.dumps(list(first.seen.values())))  # as saved and read back
    with MatmulShapes() as again:
        assert replay(entries, torch.device("cpu")) == len(entries)
    assert set(again.seen) == set(first.seen)


def test_replay_skips_what_it_cannot_run():
    good = next(iter(_recorded().seen.values()))
    bad_shapes = ["aten.mm.default", [{"shape": [2, 3], "stride": [3, 1], "offset": 0, "dtype": "float32"}] * 2, {}]
    huge = ["aten.mm.default", [{"shape": [1 << 16, 1 << 15], "stride": [1 << 15, 1], "offset": 0,
                                 "dtype": "float32"}] * 2, {}]  # 8 GiB of operands: over MAX_REPLAY_BYTES, not built
    assert replay([bad_shapes, huge, good], torch.device("cpu")) == 1


def test_a_start_without_a_file_records_and_the_next_replays(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    path = shapes_file("config", 1)
    assert path.parent.parent == tmp_path and path != shapes_file("config", 2)
    first = MatmulWarm(path, torch.device("cpu")).start()
    assert first.thread is None and first.recorder is not None
    with torch.inference_mode(), first.recording():
        _products()
    first.save()
    assert len(json.loads(path.read_text())) == 5

    second = MatmulWarm(path, torch.device("cpu")).start()
    assert second.recorder is None and second.thread is not None
    second.join()
    assert second.ran == 5
    with second.recording():  # nothing is recorded once a file was found
        _products()
    second.save()
    assert len(json.loads(path.read_text())) == 5


def test_switched_off_neither_replays_nor_records(tmp_path, monkeypatch):
    monkeypatch.setattr(matmul_warm, "ENABLED", False)
    warm = MatmulWarm(tmp_path / "shapes.json", torch.device("cpu")).start()
    assert warm.thread is None and warm.recorder is None
    with warm.recording():
        _products()
    warm.save()
    assert not (tmp_path / "shapes.json").exists()
