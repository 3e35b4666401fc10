"""Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) without its repeated language patching.

Each kernel launch patches triton.language for the interpreter and restores it afterwards; Triton 3.6 also
re-patches it on every call of a nested @triton.jit function (``round_to``, ``_rotate``...), the same module
attributes set to equal values again, never restored. That re-patching was ~40% of an interpreted kernel's
time in the TP tests. ``skip_nested_repatching`` keeps the launch's patch and skips a nested call's when the
launch already patched the modules the nested function sees: what the kernels compute is unchanged.
"""

from __future__ import annotations

import inspect
import os
import threading


def skip_nested_repatching() -> None:
    """Install the shortcut in this process (once; nothing without TRITON_INTERPRET=1 or on another
    Triton whose interpreter lacks the hook)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "skips_nested", False) or not hasattr(interpreter, "_LangPatchScope"):
        return
    langs_of: dict = {}  # function -> ids of the language modules its globals hold (what _patch_lang patches)
    state = threading.local()  # .patched: the modules this thread's running launch has patched

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        patched = getattr(state, "patched", None)
        if patched is not None:  # a nested call, inside a launch
            if langs and langs <= patched:
                return interpreter._LangPatchScope()  # already patched: nothing to set, nothing to restore
            state.patched = patched | langs  # (Triton's nested patch is never restored either)
            return original(fn)
        scope = original(fn)  # a launch: restored when its grid is done
        state.patched = langs
        restore = scope.restore

        def restore_and_forget():
            try:
                restore()
            finally:
                state.patched = None

        scope.restore = restore_and_forget
        return scope

    patch_lang.skips_nested = True
    interpreter._patch_lang = patch_lang
