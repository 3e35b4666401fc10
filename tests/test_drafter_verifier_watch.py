"""A drafter whose verifier has gone for good exits for its supervisor to restart it beside the verifier as it now
is (``--exit-without-verifier-s``; compose's drafter shares the verifier container's namespaces, which a restarted
verifier container does not keep)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from drafter.verifier_watch import VerifierWatch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_watch_waits_for_a_first_verifier_however_long_it_takes():
    clock = Clock()
    watch = VerifierWatch(5.0, clock)
    clock.now += 3600
    assert not watch.overdue()


def test_a_verifier_gone_past_the_grace_is_overdue_and_one_back_within_it_is_not():
    clock = Clock()
    watch = VerifierWatch(5.0, clock)
    watch.connected()
    clock.now += 60
    assert not watch.overdue(), "a connected verifier, however long"
    watch.disconnected()
    clock.now += 4.9
    assert not watch.overdue()
    watch.connected()  # back within the grace (a verifier's reconnect)
    clock.now += 10
    assert not watch.overdue()
    watch.disconnected()
    clock.now += 5.0
    assert watch.overdue()


def test_a_stream_ending_while_another_is_open_leaves_the_verifier_connected():
    clock = Clock()
    watch = VerifierWatch(5.0, clock)
    watch.connected()
    watch.connected()  # a reconnecting verifier's new stream before the old handler ended
    watch.disconnected()
    clock.now += 60
    assert not watch.overdue()
    watch.disconnected()
    clock.now += 5
    assert watch.overdue()


def test_the_watch_stops_the_service_and_says_why():
    clock = Clock()
    watch = VerifierWatch(2.0, clock)
    watch.connected()
    watch.disconnected()

    async def run():
        stop = asyncio.Event()
        task = asyncio.create_task(watch.watch(stop, poll_s=0.001))
        await asyncio.sleep(0.01)
        assert not stop.is_set() and not watch.fired
        clock.now += 2.0
        await asyncio.wait_for(task, 5)
        return stop.is_set()

    assert asyncio.run(run()) and watch.fired
    assert "--exit-without-verifier-s" in str(watch.error())


@pytest.mark.slow
def test_a_drafter_whose_verifier_left_exits_after_the_grace(pair_dirs, tmp_path):
    from services import start_pair

    drafter, verifier = start_pair(pair_dirs, tmp_path, drafter_args=("--exit-without-verifier-s", "1"))
    try:
        time.sleep(2)  # connected longer than the grace: no exit while a verifier is there
        assert drafter.proc.poll() is None, drafter.log()
        verifier.stop()  # (its stream ends as it drains: the grace runs from then, inside this call; the unit tests
        try:  # time the grace)
            code = drafter.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("the drafter did not exit after its verifier left:\n" + drafter.log())
        assert code == 2, drafter.log()
        assert "no verifier has connected for 1 s" in drafter.log()
    finally:
        verifier.stop()
        drafter.stop()
