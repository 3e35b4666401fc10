"""Kernels compiled after start-up.

A service says SERVING once its warm-up has run what requests run, so that no request waits for a compilation. A
Triton kernel specialised anew after that — a new constexpr, an integer argument whose divisibility by 16 changed, a
dtype — is a first use that some step pays for: tens to hundreds of milliseconds of one step (the bench's batch
section saw first runs of a shorter chain at batch 64 take 54–251 ms a step, 6–29 later). ``watch_compiles`` logs
each such kernel once with its specialisation and how long it took (compiling it, or loading it from Triton's disk
cache), so that the warm-up can be made to cover it; ``compiled_while_serving`` lists them. The verifier calls it once
its warm-up is done; a drafter service's kernels are first run by the verifier's warm-up, after the drafter says
SERVING, and are not watched.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("tandem.kernels")

compiled_while_serving: list[tuple[str, float]] = []  # (the kernel's specialisation, milliseconds)
_started: dict[str, float] = {}


def watch_compiles() -> bool:
    """From now on, log every Triton kernel compiled (or loaded from its disk cache) in this process; → whether
    the watch is on (False: no triton). Hooks installed before are still called."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = knobs.runtime
    if getattr(runtime.jit_cache_hook, "tandem_watch", False):
        return True
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def missed(**kwargs):
        if not kwargs.get("is_manual_warmup"):
            _started[kwargs["repr"]] = time.perf_counter()
        return before(**kwargs) if before else None

    def compiled(**kwargs):
        started = _started.pop(kwargs["repr"], None)
        if started is not None:
            ms = 1e3 * (time.perf_counter() - started)
            # (the repr names the kernel, not always what it was specialised on: its constants and arguments' key say)
            specialisation = " ".join(f"{kwargs['repr']} constants {kwargs.get('constants')} key {kwargs.get('key')}"
                                      .split())
            compiled_while_serving.append((specialisation, ms))
            log.warning("a Triton kernel was compiled while serving (%.0f ms, in a step that waited for it; the "
                        "warm-up did not run it): %s", ms, specialisation)  # (on one line: its repr spans several)
        return after(**kwargs) if after else None

    missed.tandem_watch = True
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = missed, compiled
    return True
