"""EngineProcess's commands reach the engine's process from a thread of their own (verifier/engine_process.py): a long
prompt whose write waits on the child's reader (which shares the child's GIL with the engine loop) no longer holds
the caller, the server's event loop; commands keep their order; a submission that cannot be sent is refused."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.sampling import SamplingParams
from verifier.engine_api import Submission
from verifier.engine_process import EngineProcess


class _SlowPipe:
    """The commands' end of a pipe whose reader is held until ``release`` is set."""

    def __init__(self):
        self.release, self.sent = threading.Event(), []

    def send_bytes(self, data: bytes) -> None:
        import pickle

        assert self.release.wait(10)
        self.sent.append(pickle.loads(data))


@pytest.fixture
def engine_process():
    process = EngineProcess(cfg=None)
    process._commands = pipe = _SlowPipe()
    process._writer = threading.Thread(target=process._write, daemon=True)
    process._writer.start()
    yield process, pipe
    pipe.release.set()
    process._outbox.put(None)
    process._writer.join(5)


class _PicklesWithValueError:
    def __reduce__(self):
        raise ValueError("does not pickle")


def _sub(rid: str, prompt) -> Submission:
    return Submission(rid, prompt, SamplingParams(max_new_tokens=4), None, lambda out: None)


def test_a_submission_returns_while_its_write_waits_and_commands_keep_their_order(engine_process):
    process, pipe = engine_process
    started = time.perf_counter()
    long_sub = _sub("long", list(range(100_000)))
    process.submit(long_sub)
    process.cancel("long", long_sub)
    process.submit(_sub("short", [1, 2, 3]))
    assert time.perf_counter() - started < 1.0 and not pipe.sent  # (the writer waits on the reader; the caller did not)
    pipe.release.set()
    deadline = time.monotonic() + 10
    while len(pipe.sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(m[0], m[2] if m[0] == "add" else m[1]) for m in pipe.sent] == [("add", "long"), ("cancel", "long"),
                                                                             ("add", "short")]
    assert pipe.sent[0][3] == list(range(100_000))


def test_a_submission_that_cannot_be_sent_is_refused(engine_process):
    process, pipe = engine_process
    pipe.release.set()
    sub = _sub("bad", [1, 2])
    sub.cache_salt = threading.Lock()  # (does not pickle: TypeError)
    with pytest.raises(TypeError):
        process.submit(sub).result(10)
    odd = _sub("odd", [1])
    odd.cache_salt = _PicklesWithValueError()  # (an error the pipe's own failures share: refused all the same)
    with pytest.raises(ValueError):
        process.submit(odd).result(10)
    good = process.submit(_sub("good", [1]))
    deadline = time.monotonic() + 10
    while not pipe.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [m[2] for m in pipe.sent] == ["good"] and not good.done()  # (the writer went on; the child answers it)
