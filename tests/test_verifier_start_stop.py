"""Stopping the verifier while it loads its model: a Ctrl-C (SIGINT) or SIGTERM during a load of minutes must stop the
start at once, not wait for the load to end (its event loop slept through Python's own SIGINT handler, and it served
after the load), on a thread or with the engine in a process of its own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from services import ROOT, free_port

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine_process", [False, True])
def test_a_signal_while_the_model_loads_stops_the_start(tmp_path, engine_process):
    # a config alone, random weights: ~0.8 B parameters take tens of seconds to make on a CPU
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "eos_token_id": 2}))
    log = tmp_path / "verifier.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "verifier", "--model", str(tmp_path), "--load-format", "random",
                                 "--port", str(free_port()), "--device", "cpu",
                                 *(["--engine-process"] if engine_process else [])],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "loading" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # (inside the load)
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        code = proc.wait(30)
        took = time.monotonic() - started
    finally:
        proc.kill()
    text = log.read_text()
    assert code == 0 and "stopped while loading" in text and "serving on" not in text, text
    assert took < 15, f"{took:.1f} s to stop"
