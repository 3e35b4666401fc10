"""bench/spy.py folds py-spy's raw stacks by thread: with ``--subprocesses`` each stack starts with the chain of
processes down to the sampled one (a spawned child's command line holds ";"), then its thread; the engine's kind is
its thread's alone, not its process's other threads' idle samples."""

from __future__ import annotations

from bench_modules import import_bench

(spy,) = import_bench("spy")

SERVER = 'process 10:"python -m verifier --port 1"'
CHILD = 'process 11:"python -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)"'


def test_threads_of_a_child_process_are_folded_apart_and_only_the_engines_counts_as_it(tmp_path):
    raw = tmp_path / "in-process-c1-0.txt"
    raw.write_text("\n".join([
        f"{SERVER};thread (1): MainThread;run (runners.py:118);select (selectors.py:2) 5",
        f"{SERVER};{CHILD};thread (2): engine-loop;step (tandem/engine/llm_engine.py:3);forward (m.py:4) 40",
        f"{SERVER};{CHILD};thread (3): metrics;serve (metrics.py:9);select (selectors.py:2) 60",
        "thread (7): MainThread;older (a.py:1) 3",  # (a file without --subprocesses)
    ]) + "\n")
    stacks = list(spy._stacks(raw))
    assert [(thread, names[-1], n) for thread, names, n in stacks] == [
        ("process 10 thread (1): MainThread", "select (selectors.py)", 5),
        ("process 11 thread (2): engine-loop", "forward (m.py)", 40),
        ("process 11 thread (3): metrics", "select (selectors.py)", 60),
        ("thread (7): MainThread", "older (a.py)", 3)]
    kinds = spy.fold([raw])
    assert kinds["engine"]["samples"] == 40 and kinds["engine"]["self"]["forward (m.py)"] == 40
