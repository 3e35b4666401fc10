"""Models named as users name them: a Hugging Face id (and --revision) resolved through the Hugging Face
cache (huggingface_hub's own layout, written here as the hub writes it: refs/<revision> holds the commit,
snapshots/<commit>/ the files), served under the id, a clear error naming the id and the cache when the cache
does not have it (offline); local folders as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tandem.errors import ConfigError
from tandem.model_source import hub_id, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture()
def hub(tmp_path, monkeypatch, llama):
    """A Hugging Face cache holding the tests' tiny Llama as org/tiny-llama at main and at a tag."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-llama"
    for commit, ref in ((COMMIT, "main"), (OTHER, "v1")):
        shutil.copytree(llama.path, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo


def test_an_id_resolves_to_its_snapshot_and_is_served_under_it(hub):
    from tandem.args import served_name

    folder = resolve_model("org/tiny-llama")
    assert Path(folder) == hub / "snapshots" / COMMIT and (Path(folder) / "config.json").is_file()
    assert Path(resolve_model("org/tiny-llama", revision="v1")) == hub / "snapshots" / OTHER
    assert hub_id(folder) == "org/tiny-llama" and served_name(folder, None) == "org/tiny-llama"
    assert served_name(folder, "mine") == "mine"


def test_an_id_the_cache_lacks_is_one_clear_error_offline(hub):
    with pytest.raises(ConfigError, match=r"--model org/absent: not in the Hugging Face cache .*hub.* HF_HUB_OFFLINE"):
        resolve_model("org/absent")
    with pytest.raises(ConfigError, match="no such folder"):
        resolve_model("./not-here")


def test_local_folders_are_as_given(llama):
    assert resolve_model(llama.path) == llama.path
    with pytest.raises(ConfigError, match="--revision"):
        resolve_model(llama.path, revision="main")


def test_the_services_take_an_id(hub):
    from verifier.__main__ import build_parser
    from verifier.config import VerifierConfig

    from tandem import args as shared

    args = build_parser().parse_args(["--model", "org/tiny-llama", "--revision", "v1"])
    model = shared.resolve_target(args)
    assert Path(model) == hub / "snapshots" / OTHER
    assert Path(VerifierConfig.from_args(args, model).engine.model) == hub / "snapshots" / OTHER
    from gateway.config import build_parser as gateway_parser, config_from_args

    cfg = config_from_args(gateway_parser().parse_args(["--verifier", "127.0.0.1:1", "--model-dir", "org/tiny-llama"]))
    assert Path(cfg.model_dir) == hub / "snapshots" / COMMIT and cfg.model_name == "org/tiny-llama"


def test_a_bin_only_head_is_served_from_a_safetensors_copy(tmp_path, monkeypatch, checkpoint):
    """Published EAGLE-3 heads often ship pytorch_model.bin: the folder resolves to a copy holding the same
    tensors as safetensors (made once), which validates against its target as the original does."""
    import torch
    from safetensors.torch import load_file

    from draft_checkpoints import make_draft
    from tandem.configs.model import ModelConfig
    from tandem.configs.eagle3 import DraftConfig, validate_draft

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    target = ModelConfig.from_dir(checkpoint("llama", num_hidden_layers=6).path)
    original = tmp_path / "head-st"
    make_draft(original, target, seed=4)
    tensors = load_file(str(original / "model.safetensors"))
    published = tmp_path / "head-bin"
    shutil.copytree(original, published)
    (published / "model.safetensors").unlink()
    torch.save(tensors, published / "pytorch_model.bin")

    served = Path(resolve_model(str(published), flag="--draft-model"))
    assert served != published and not list(served.glob("*.bin"))
    converted = load_file(str(served / "model.safetensors"))
    assert converted.keys() == tensors.keys() and all(torch.equal(converted[k], tensors[k]) for k in tensors)
    assert validate_draft(DraftConfig.from_dir(served), target) == validate_draft(DraftConfig.from_dir(original), target)
    assert resolve_model(str(published)) == str(served)  # made once
    assert resolve_model(str(original)) == str(original)  # safetensors: as given


def test_a_download_that_fails_without_a_network_is_one_line_with_the_way_out(hub, monkeypatch):
    import huggingface_hub

    def unreachable(name, **kwargs):
        if kwargs.get("local_files_only"):
            raise FileNotFoundError("not cached")
        raise ConnectionError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while "
                              "trying to locate the files on the Hub")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ConfigError) as e:
        resolve_model("moonshotai/Kimi-K2.5")
    said = str(e.value)
    assert "\n" not in said and "Name or service not known An error happened" in said, said
    assert said.endswith("no network here? give a local folder, or set HF_HUB_OFFLINE=1 with the model in the cache")
