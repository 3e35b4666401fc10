"""The watchdog reports a hung step within its deadline, with stacks, and exits non-zero."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tandem.watchdog import HUNG_EXIT_CODE, Watchdog


def test_a_step_within_its_deadline_is_left_alone():
    dog = Watchdog(exit_code=None)
    with dog.guard("quick step", deadline_s=1.0):
        time.sleep(0.05)
    time.sleep(0.2)
    assert dog.fired == []


def test_a_simulated_hung_capture_is_reported_and_the_process_exits():
    code = textwrap.dedent("""
        import time
        from tandem.watchdog import Watchdog
        def simulated_capture():  # stands for a CUDA graph capture that never returns
            time.sleep(60)
        dog = Watchdog(on_hang=lambda what: print("HEALTH NOT_SERVING:", what, flush=True))
        with dog.guard("Capture decode cuda graph bs=8", deadline_s=0.5):
            simulated_capture()
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    elapsed = time.monotonic() - started
    assert proc.returncode == HUNG_EXIT_CODE
    assert elapsed < 10, "reported well within the test's patience, not after the 60 s hang"
    assert "HEALTH NOT_SERVING: Capture decode cuda graph bs=8" in proc.stdout
    assert "Capture decode cuda graph bs=8 exceeded its deadline" in proc.stderr
    assert "simulated_capture" in proc.stderr, "the hung thread's stack is in the report"


def test_a_hang_turns_grpc_health_not_serving():
    """The service hook: a watchdog firing flips the health servicer before the process would exit."""
    import asyncio
    import threading

    from grpc_health.v1 import health, health_pb2

    from tandem.service_runtime import report_hangs_in_health

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    servicer = health.aio.HealthServicer()
    asyncio.run_coroutine_threadsafe(servicer.set("", health_pb2.HealthCheckResponse.SERVING), loop).result(5)
    report_hangs_in_health(servicer, loop)
    dog = Watchdog(exit_code=None)
    with dog.guard("replay decode cuda graph bs=1", deadline_s=0.2):
        deadline = time.monotonic() + 10  # a loaded machine may starve the watchdog's thread for a while
        while not dog.fired and time.monotonic() < deadline:
            time.sleep(0.05)
    request = health_pb2.HealthCheckRequest(service="")
    status = None
    for _ in range(100):  # the hook flips health on the service's loop, right after firing
        status = asyncio.run_coroutine_threadsafe(servicer.Check(request, None), loop).result(5).status
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        time.sleep(0.05)
    assert dog.fired == ["replay decode cuda graph bs=1"]
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    loop.call_soon_threadsafe(loop.stop)
