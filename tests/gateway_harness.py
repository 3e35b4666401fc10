"""A gateway in front of the fake verifier, both on real sockets of 127.0.0.1, on one uvloop event
loop in a background thread, so tests can use ordinary blocking clients (openai, httpx, grpc)."""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from fake_verifier import FakeVerifier, expected_tokens, start_fake_verifier

from gateway.config import GatewayConfig
from gateway.server import Gateway
from tandem.tokenizer import TextTokenizer

MODEL_NAME = "tiny"
BOS = "<|bos|>"


@functools.cache
def tiny_model_dir() -> Path:
    """A model folder with a small byte-level BPE tokenizer and the demo's chat template (no
    weights: the gateway only reads the tokenizer files). Built once per test process (~0.4 s)."""
    from tandem.training.stdlib_text import train_tokenizer

    root = Path(tempfile.mkdtemp(prefix="tandem-gw-"))
    atexit.register(shutil.rmtree, root, True)
    folder = root / MODEL_NAME
    folder.mkdir()
    train_tokenizer(folder, vocab_size=512)
    return folder


def tiny_model_copy(folder: Path, *, bos_post_processor: bool = False, chat_template: str | None = None,
                    generation_config: dict | None = None) -> Path:
    """A copy of tiny_model_dir() at ``folder`` (its name is the model's name), optionally with a
    Llama-3-like post-processor (``<|bos|> $A``: add_special_tokens makes a difference), another chat
    template, or a generation_config.json."""
    shutil.copytree(tiny_model_dir(), folder)
    if bos_post_processor:
        spec = json.loads((folder / "tokenizer.json").read_text())
        bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == BOS)
        bos, a = {"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
        spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, a],
                                  "pair": [bos, a, {"Sequence": {"id": "B", "type_id": 1}}],
                                  "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}}}
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    if chat_template is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


@functools.cache
def vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model_dir() / "tokenizer.json")).get_vocab_size()


class Stack:
    """Fake verifier + gateway. ``url`` is the OpenAI base URL, ``grpc_target`` the public gRPC one."""

    def __init__(self, verifier: str | None = None, model_dir: str | Path | None = None, **config):
        self.model_dir = str(model_dir or tiny_model_dir())
        self.tok = TextTokenizer(self.model_dir)
        self.vocab_size = vocab_size()
        self._verifier_addr = verifier
        self._config = config
        import uvloop

        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-test-loop", daemon=True)
        self._thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self.fake: FakeVerifier | None = None
        self._fake_server = None
        address = self._verifier_addr
        if address is None:
            self._fake_server, self.fake, port = await start_fake_verifier(self.vocab_size, max_context=512)
            address = f"127.0.0.1:{port}"
        quick = dict(health_poll_s=0.1, upstream_timeout_s=1.0, shutdown_grace_s=1.0)  # (a test's config wins)
        cfg = GatewayConfig(verifier=address, model_dir=self.model_dir, host="127.0.0.1", port=0, grpc_port=0,
                            **{**quick, **self._config})
        self.gateway = Gateway(cfg)
        await self.gateway.start()
        self.url = f"http://127.0.0.1:{self.gateway.port}"
        self.grpc_target = f"127.0.0.1:{self.gateway.grpc_port}"

    def run(self, coro, timeout: float = 30.0):
        """Run ``coro`` on the stack's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def expected(self, prompt_ids: list[int], n: int) -> list[int]:
        return expected_tokens(prompt_ids, n, self.vocab_size)

    def close(self) -> None:
        self.run(self.gateway.stop())
        if self._fake_server is not None:
            self.run(self._fake_server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


def stack_fixture(*, model_dir_from: str | None = None, after: tuple[str, ...] = (), **config):
    """A module-scoped ``stack`` fixture: one Stack(**config) for a test module, closed after it.
    ``model_dir_from`` names the fixture that gives its model folder (else tiny_model_dir()); ``after``
    names fixtures to set up before the stack starts (tracing's exporter). In a test module:
    ``stack = stack_fixture(max_tokens_limit=300)``."""

    @pytest.fixture(scope="module")
    def stack(request):
        for name in after:
            request.getfixturevalue(name)
        kw = dict(config)
        if model_dir_from is not None:
            kw["model_dir"] = request.getfixturevalue(model_dir_from)
        s = Stack(**kw)
        yield s
        s.close()

    return stack


def wait_until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def metric_value(text: str, name: str, **labels) -> float:
    """The sum of a Prometheus text exposition's samples of ``name`` that carry ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total
