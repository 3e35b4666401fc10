"""The watch on kernels compiled after start-up (tandem.kernels.compile_watch), driven as Triton's JIT drives its
hooks (triton.runtime.jit: ``jit_cache_hook`` on an in-memory cache miss, before compiling or loading from the disk
cache; ``jit_post_compile_hook`` once the kernel is built; both with the same keyword arguments)."""

from __future__ import annotations

import logging

import pytest

triton = pytest.importorskip("triton")


def _hook_kwargs(name: str, warmup: bool = False) -> dict:
    return dict(key=(name,), repr=f"{name}[num_warps=4](x: *bf16, n: i32)", fn=None, compile={},
                is_manual_warmup=warmup, already_compiled=False)


def test_a_kernel_compiled_after_start_up_is_logged_with_its_specialisation_and_earlier_hooks_still_run(caplog):
    from triton import knobs

    from tandem.kernels import compile_watch

    runtime = knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    calls = []
    runtime.jit_cache_hook = lambda **kw: calls.append(("miss", kw["repr"]))
    runtime.jit_post_compile_hook = lambda **kw: calls.append(("built", kw["repr"]))
    try:
        assert compile_watch.watch_compiles() and compile_watch.watch_compiles()  # (a second call adds nothing)
        with caplog.at_level(logging.WARNING, logger="tandem.kernels"):
            assert runtime.jit_cache_hook(**_hook_kwargs("round_glue")) is None  # (None: Triton goes on compiling)
            runtime.jit_post_compile_hook(**_hook_kwargs("round_glue"))
            runtime.jit_cache_hook(**_hook_kwargs("manual", warmup=True))  # (kernel.warmup(): not a request's)
            runtime.jit_post_compile_hook(**_hook_kwargs("manual", warmup=True))
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "compiled while serving" in lines[0] and "round_glue[num_warps=4]" in lines[0]
        assert [name for name, _ in compile_watch.compiled_while_serving][-1].startswith("round_glue")
        assert calls == [("miss", _hook_kwargs("round_glue")["repr"]), ("built", _hook_kwargs("round_glue")["repr"]),
                         ("miss", _hook_kwargs("manual")["repr"]), ("built", _hook_kwargs("manual")["repr"])]
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved
