"""Clear one-line errors: broken checkpoints (CheckpointError naming the file, tensor and shapes) and
bad requests (ConfigError naming the field), and the engine keeps serving after a refused request."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import greedy_alone, random_prompt
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import CheckpointError, ConfigError, TandemError
from tandem.sampling import SamplingParams


@pytest.fixture
def broken(llama, tmp_path):
    """A fresh copy of the llama checkpoint to break."""
    folder = tmp_path / "model"
    shutil.copytree(llama.path, folder)
    return folder


def load_error(folder) -> str:
    with pytest.raises(CheckpointError) as info:
        LLMEngine(EngineConfig(model=str(folder)))
    msg = str(info.value)
    assert "\n" not in msg, f"not one line: {msg!r}"
    return msg


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    path.write_text(json.dumps(raw))


def rewrite_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------- checkpoints


def test_unsupported_architecture(broken):
    edit_config(broken, architectures=["GPT2LMHeadModel"])
    msg = load_error(broken)
    assert "GPT2LMHeadModel" in msg
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in msg, msg


def test_no_config_json(broken):
    (broken / "config.json").unlink()
    msg = load_error(broken)
    assert "config.json" in msg and str(broken) in msg


def test_config_not_json(broken):
    (broken / "config.json").write_text("{not json")
    assert "config.json" in load_error(broken)


def test_missing_config_field(broken):
    edit_config(broken, hidden_size=None)
    assert "hidden_size" in load_error(broken)


def test_unsupported_rope_type(broken):
    edit_config(broken, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    msg = load_error(broken)
    assert "yarn" in msg and "llama3" in msg


def test_missing_tensor(broken):
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_tensors(broken, lambda t: t.pop(name))
    assert name in load_error(broken)


def test_wrong_tensor_shape(broken):
    name = "model.layers.0.self_attn.k_proj.weight"  # [2 kv heads * 16, 64]
    rewrite_tensors(broken, lambda t: t.__setitem__(name, torch.zeros(31, 64)))
    msg = load_error(broken)
    assert "model.safetensors" in msg and name in msg
    assert "(31, 64)" in msg and "(32, 64)" in msg, msg


def test_unexpected_tensor(broken):
    name = "model.layers.0.self_attn.extra_proj.weight"
    rewrite_tensors(broken, lambda t: t.__setitem__(name, torch.zeros(4, 4)))
    assert name in load_error(broken)


def test_no_safetensors_files(broken):
    (broken / "model.safetensors").unlink()
    assert "safetensors" in load_error(broken)


def test_sharded_index_lists_missing_shard(checkpoint, tmp_path):
    src = Path(checkpoint("llama", seed=5, max_shard_size="50KB").path)
    folder = tmp_path / "sharded"
    shutil.copytree(src, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (folder / shard).unlink()
    assert shard in load_error(folder)


@pytest.mark.parametrize("damage", ["truncated", "empty", "wrong shard in the index"])
def test_a_damaged_shard_is_one_line_naming_it(checkpoint, tmp_path, damage):
    """What an interrupted download of a large checkpoint looks like: one line naming the file, no traceback."""
    src = Path(checkpoint("llama", seed=5, max_shard_size="50KB").path)
    folder = tmp_path / "sharded"
    shutil.copytree(src, folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    if damage == "wrong shard in the index":
        name = next(n for n, f in index["weight_map"].items() if f == shards[0])
        index["weight_map"][name] = shards[1]
        index_path.write_text(json.dumps(index))
        expected = [name, shards[1], "model.safetensors.index.json"]
    else:
        data = (folder / shards[1]).read_bytes()
        (folder / shards[1]).write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
        expected = [shards[1], "not a whole safetensors file"]
    msg = load_error(folder)
    assert all(part in msg for part in expected) and "\n" not in msg, msg


def test_a_verifier_that_cannot_load_its_model_says_so_in_one_line_and_exits(broken):
    """The service, started as a user starts it: the checkpoint's one-line error and a non-zero exit, with no
    traceback after it (the gRPC server, started before the load, used to be collected after its loop closed)."""
    import subprocess
    import sys

    from tandem.service_probe import free_port

    rewrite_tensors(broken, lambda t: t.pop("model.layers.0.mlp.down_proj.weight"))
    run = subprocess.run([sys.executable, "-m", "verifier", "--model", str(broken), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "missing tensor 'model.layers.0.mlp.down_proj.weight'" in run.stderr
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr


def test_unknown_dtype_is_a_clear_error(llama):
    with pytest.raises(TandemError) as info:
        LLMEngine(EngineConfig(model=llama.path, dtype="float8"))
    assert "float8" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("field, kw", [("tp-size", dict(tp_size=0)), ("page size", dict(page_size=0)),
                                       ("device", dict(device="tpu")),
                                       ("mem-fraction-static", dict(mem_fraction_static=1.5))])
def test_bad_engine_config(llama, field, kw):
    with pytest.raises(ConfigError) as info:
        EngineConfig(model=llama.path, **kw)
    assert field in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------- requests


BAD_REQUESTS = [
    ("prompt", [], {}),
    ("prompt", list(range(3, 3 + 600)), {}),  # longer than max_position_embeddings (512)
    ("prompt", [3] * 512, {}),  # exactly the context: no room for a new token
    ("256", [5, 256, 7], {}),  # token id == vocab size
    ("-1", [5, -1, 7], {}),
    ("temperature", [5, 6], dict(temperature=-0.5)),
    ("temperature", [5, 6], dict(temperature=float("nan"))),
    ("top_p", [5, 6], dict(top_p=0.0)),
    ("top_p", [5, 6], dict(top_p=1.5)),
    ("top_k", [5, 6], dict(top_k=-2)),
    ("max_new_tokens", [5, 6], dict(max_new_tokens=0)),
]


@pytest.fixture(scope="module")
def engine(llama):
    with LLMEngine(EngineConfig(model=llama.path, kv_pages=64)) as eng:
        yield eng


@pytest.mark.parametrize("named, prompt, kw", BAD_REQUESTS)
def test_bad_request_is_refused_with_the_field_named(engine, named, prompt, kw):
    free = engine.allocator.num_free
    with pytest.raises(ConfigError) as info:
        engine.add_request(prompt, SamplingParams(**kw))
    msg = str(info.value)
    assert named in msg, msg
    assert "\n" not in msg
    assert engine.requests == {} and not engine.has_unfinished()
    assert engine.allocator.num_free == free


def test_context_message_names_the_limit(engine):
    with pytest.raises(ConfigError) as info:
        engine.add_request(list(range(3, 603)), SamplingParams())
    assert "600" in str(info.value) and "512" in str(info.value)


def test_duplicate_request_id(engine, llama):
    prompt = random_prompt(60, 5)
    engine.add_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True), rid="same")
    try:
        with pytest.raises(ConfigError) as info:
            engine.add_request(prompt, SamplingParams(), rid="same")
        assert "same" in str(info.value)
    finally:
        engine.abort("same")
    assert engine.allocator.num_free == engine.allocator.capacity_pages


def test_engine_serves_after_refusals(engine, llama):
    for _, prompt, kw in BAD_REQUESTS:
        with pytest.raises(ConfigError):
            engine.add_request(prompt, SamplingParams(**kw))
    prompt = random_prompt(61, 9)
    [r] = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert r.output_token_ids == greedy_alone(llama.path, prompt, 10)
    # The longest acceptable prompt (context - 1 tokens) is served.
    [r] = engine.generate([[7] * 511], SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert len(r.output_token_ids) == 1
