"""A gateway in front of the fake verifier, both on real sockets of 127.0.0.1, on one uvloop event
loop in a background thread, so tests can use ordinary blocking clients (openai, httpx, grpc)."""

from __future__ import annotations

import asyncio
import atexit
import functools
import shutil
import tempfile
import threading
import time
from pathlib import Path

from fake_verifier import FakeVerifier, expected_tokens, start_fake_verifier

from gateway.config import GatewayConfig
from gateway.server import Gateway
from tandem.tokenizer import TextTokenizer

MODEL_NAME = "tiny"


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
        cfg = GatewayConfig(verifier=address, model_dir=self.model_dir, host="127.0.0.1", port=0, grpc_port=0,
                            health_poll_s=0.1, upstream_timeout_s=1.0, shutdown_grace_s=1.0, **self._config)
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
