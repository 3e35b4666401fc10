"""Capture itself needs a GPU. What the graph runners do around it — which graphs, in which order, the
padding staged before each, two warm-ups outside the graph, one memory pool, one log line per family,
a guard per capture — is checked here on the CPU, with torch.cuda's capture calls replaced by recorders
and the real runners' bodies running eagerly on the CPU."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from draft_checkpoints import pair_drafter
from helpers import TorchGraphBackend
from tandem import graph_capture
from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graph import PLAIN_DECODE, TargetGraphRunner
from tandem.engine.llm_engine import LLMEngine
from tandem.graph_capture import GraphRunner, batch_buckets
from tandem.speculative.draft_graph import DraftGraphRunner
from tandem.speculative.spec_config import SpecConfig


class Recorder:
    """Stands in for torch.cuda's capture calls; ``events`` in call order."""

    def __init__(self):
        self.events: list[tuple] = []
        self.capturing = False
        self.pools = 0
        recorder = self

        class Graph:
            def replay(self):
                recorder.events.append(("replay", self))

        self.Graph = Graph

    def install(self, monkeypatch):
        stream = type("Stream", (), {"wait_stream": lambda s, other: None, "synchronize": lambda s: None})()
        monkeypatch.setattr(graph_capture, "capture_stream", lambda device: stream)
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "current_stream", lambda device=None: stream)
        monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (10**9, 2 * 10**9))
        monkeypatch.setattr(cuda, "CUDAGraph", self.Graph)
        monkeypatch.setattr(cuda, "graph_pool_handle", self._pool)
        monkeypatch.setattr(cuda, "graph", self._graph)

    def _pool(self):
        self.pools += 1
        return ("pool", self.pools)

    @contextlib.contextmanager
    def _graph(self, graph, pool=None, stream=None):
        self.events.append(("capture", graph, pool))
        self.capturing = True
        yield
        self.capturing = False


class Toy(GraphRunner):
    """A runner whose bodies and padding only say what they were called with."""

    def __init__(self, recorder, buckets, pool=None):
        super().__init__(torch.device("cpu"), buckets, use_graphs=True, log_name="tests.toy_graphs", pool=pool)
        self.recorder = recorder

    def capture_plan(self):
        return [("wide", ["w8", "w4"]), ("narrow", ["w1"])]

    def _body(self, member, bs):
        self.recorder.events.append(("body", member, bs, self.recorder.capturing))

    def _pad_all(self, member, bs):
        self.recorder.events.append(("pad", member, bs))


def test_every_member_and_bucket_is_captured_largest_first_after_padding_and_its_warm_ups(monkeypatch, caplog):
    rec = Recorder()
    rec.install(monkeypatch)
    toy = Toy(rec, [4, 1, 2, 2])
    assert toy.buckets == [1, 2, 4] and toy.max_bs == 4
    with caplog.at_level(logging.INFO, logger="tests.toy_graphs"):
        report = toy.capture()
    assert list(report) == ["wide", "narrow"]
    assert [r.getMessage().split(" cuda graph end")[0] for r in caplog.records] == ["Capture wide", "Capture narrow"]
    order = [(m, bs) for m in ("w8", "w4", "w1") for bs in (4, 2, 1)]
    assert [key for key in toy.graphs] == order
    events = list(rec.events)
    for member, bs in order:
        graph = toy.graphs[(member, bs)]
        warm_ups = 2 if bs == 4 else 1  # two eager runs at a member's first (largest) bucket, one at the others
        expected = ([("pad", member, bs)] + [("body", member, bs, False)] * warm_ups
                    + [("capture", graph, ("pool", 1)), ("body", member, bs, True), ("replay", graph)])
        assert events[: len(expected)] == expected
        del events[: len(expected)]
    assert events == []
    assert rec.pools == 1  # one pool for every graph

    rec.events.clear()
    toy._launch("w4", 2)
    assert rec.events == [("replay", toy.graphs[("w4", 2)])]
    assert toy.bucket(3) == 4 and toy.bucket(5) is None


def test_a_pool_given_is_the_one_captured_into(monkeypatch):
    rec = Recorder()
    rec.install(monkeypatch)
    toy = Toy(rec, [1], pool="shared")
    toy.capture()
    assert rec.pools == 0 and {e[2] for e in rec.events if e[0] == "capture"} == {"shared"}


def test_without_graphs_a_launch_runs_the_body():
    rec = Recorder()
    toy = Toy(rec, [1, 2])
    toy.use_graphs = False
    toy._launch("w1", 2)
    assert rec.events == [("body", "w1", 2, False)]


def test_buckets_are_dense_to_8_then_every_8_to_64_then_every_16():
    assert batch_buckets(5) == [1, 2, 3, 4, 5]
    assert batch_buckets(64) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]


def test_the_target_runner_captures_decode_and_verify_widths_on_padding_rows(pair, monkeypatch):
    rec = Recorder()
    rec.install(monkeypatch)
    with LLMEngine(EngineConfig(model=str(pair.target_dir), page_size=4)) as eng:
        runner = eng.executor.runner
        runner.graph_backend = TorchGraphBackend()
        graphs = TargetGraphRunner(runner, widths=(1, 4), max_bs=3, use_graphs=True)
        report = graphs.capture()
        assert list(report) == ["verify(width=4)", "decode", "decode without features"]
        assert list(graphs.graphs) == [(4, 3), (4, 2), (4, 1), (1, 3), (1, 2), (1, 1),
                                       (PLAIN_DECODE, 3), (PLAIN_DECODE, 2), (PLAIN_DECODE, 1)]
        assert graphs.families[1].features is not None and graphs.plain_decode.features is None
        fam = graphs.families[4]
        # the last capture staged padding rows: every KV write goes to the dummy page
        assert fam.logits.shape[0] == 3 * 4 and fam.features is not None
        assert bool((fam.block_tables[:1] == 0).all()) and bool((fam.slots[:4] < runner.cfg.page_size).all())


def test_the_draft_runner_captures_each_spec_and_the_extend(pair, monkeypatch):
    rec = Recorder()
    rec.install(monkeypatch)
    drafter = pair_drafter(pair)
    specs = [SpecConfig(3, 1, 4), SpecConfig(2, 2, 4)]
    graphs = DraftGraphRunner(drafter, specs, buckets=[1, 2], use_graphs=True, attention="torch")
    report = graphs.capture()
    assert list(report) == ["draft", "draft_extend"]
    assert list(graphs.graphs) == [(specs[0], 2), (specs[0], 1), (specs[1], 2), (specs[1], 1), ("extend", 2),
                                   ("extend", 1)]
    assert int(graphs.aux[0]) == 1 and int(graphs.lens.abs().sum()) == 0  # staged as padding
    with pytest.raises(KeyError):  # a spec never captured has no graph
        graphs._launch(SpecConfig(4, 1, 5), 1)
