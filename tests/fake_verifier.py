"""A stand-in verifier for gateway tests: implements tandem.rpc.verifier.v1 with a deterministic
output (no model), streamed in messages of 1–3 tokens, and records what it was asked, the trace
context it was given and the calls that were cancelled."""

from __future__ import annotations

import asyncio
import threading

import grpc

from tandem import tracing
from tandem.rpc.verifier.v1 import verifier_pb2, verifier_pb2_grpc

SPECIAL_IDS = 3  # ids 0..2 are <|bos|>, <|eos|>, <|pad|>: the fake never emits them (unless a test scripts them)
EOS_ID = 1  # ... and stops at its EOS, unless ignore_eos


def expected_tokens(prompt: list[int], n: int, vocab_size: int) -> list[int]:
    """What the fake generates for ``prompt``: (sum(prompt) + i) mod the non-special vocabulary."""
    base = sum(prompt)
    return [SPECIAL_IDS + (base + i) % (vocab_size - SPECIAL_IDS) for i in range(n)]


def fake_logprobs(token: int, position: int, top: int, vocab_size: int) -> verifier_pb2.TokenLogprobs:
    """What the fake sends for the token at ``position`` of its output: -(position + 1) / 10, and as
    alternatives the token itself then the next ids, each 1 lower (a -inf last when there are more than 1); its rank
    over the vocabulary ``position % 7 + 1`` (a verifier's count the gateway passes on: not the alternatives' order)."""
    lp = -(position + 1) / 10
    ids = [SPECIAL_IDS + (token - SPECIAL_IDS + j) % (vocab_size - SPECIAL_IDS) for j in range(top)]
    values = [lp - j for j in range(top)]
    if top > 1:
        values[-1] = float("-inf")
    return verifier_pb2.TokenLogprobs(logprob=lp, top_token_ids=ids, top_logprobs=values, rank=position % 7 + 1)


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, vocab_size: int, max_context: int = 512):
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.delay_s = 0.0  # pause between messages (disconnect tests)
        self.fail_with: tuple[grpc.StatusCode, str] | None = None  # answer the next Generate with this status
        self.hung = False  # answer nothing (a stopped or hung verifier: its socket still accepts)
        self.requests: list[verifier_pb2.GenerateRequest] = []
        self.scores_from = True  # honours SamplingParams.prompt_logprobs_from (False: as a verifier from before it)
        self.cancelled: list[str] = []  # request ids whose call was cancelled by the client
        self.finished: list[str] = []
        self.metadata: list[dict[str, str]] = []
        self.script: list[int] | None = None  # the output instead of expected_tokens (then cut at a stop, as it)
        self._lock = threading.Lock()

    async def _hang_while_hung(self) -> None:
        while self.hung:
            await asyncio.sleep(0.05)

    async def GetModelInfo(self, request, context):
        await self._hang_while_hung()
        return verifier_pb2.ModelInfo(model="fake", vocab_size=self.vocab_size, max_context=self.max_context,
                                      eos_token_ids=[EOS_ID], speculative=True)

    async def Generate(self, request: verifier_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        md = context.invocation_metadata()
        span = tracing.start_span("verifier.generate", parent=tracing.extract_context(md), kind="server")
        with self._lock:
            self.requests.append(request)
            self.metadata.append({k: v for k, v in md if isinstance(v, str)})
        await self._hang_while_hung()
        try:
            if self.fail_with is not None:
                code, message = self.fail_with
                self.fail_with = None
                await context.abort(code, message)
            prompt = list(request.prompt_token_ids)
            if len(prompt) >= self.max_context:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"prompt: {len(prompt)} tokens do not fit the context of {self.max_context}")
            n = request.sampling.max_new_tokens
            out = list(self.script[:n]) if self.script is not None else expected_tokens(prompt, n, self.vocab_size)
            stops = set(request.sampling.stop_token_ids) | (set() if request.sampling.ignore_eos else {EOS_ID})
            cut = next((i + 1 for i, t in enumerate(out) if t in stops), None)
            if cut is not None:
                out = out[:cut]
            sent, step = 0, 0
            while sent < len(out):
                size = 1 + step % 3
                chunk = out[sent:sent + size]
                sent += len(chunk)
                step += 1
                last = sent == len(out)
                reason = ("stop" if cut is not None else "length") if last else ""
                msg = verifier_pb2.GenerateResponse(request_id=request.request_id, token_ids=chunk,
                                                    finish_reason=reason, prompt_tokens=len(prompt),
                                                    completion_tokens=sent)
                if request.sampling.HasField("prompt_logprobs") and step == 1:  # (prompt token i: position 100 + i)
                    # (as the engine: from there on; a verifier from before the field scored every prompt token)
                    start = max(1, request.sampling.prompt_logprobs_from) if self.scores_from else 1
                    msg.prompt_logprobs.extend(fake_logprobs(t, 100 + i, request.sampling.prompt_logprobs,
                                                             self.vocab_size) for i, t in enumerate(prompt[start:], start))
                if request.sampling.HasField("logprobs"):
                    msg.logprobs.extend(fake_logprobs(t, sent - len(chunk) + j, request.sampling.logprobs,
                                                      self.vocab_size) for j, t in enumerate(chunk))
                if last:
                    msg.spec.rounds = step
                    msg.spec.accept_length_mean = sent / step
                yield msg
                if self.delay_s and not last:
                    await asyncio.sleep(self.delay_s)
            with self._lock:
                self.finished.append(request.request_id)
        except (asyncio.CancelledError, GeneratorExit):
            # A cancel that arrives while grpc.aio sends a message closes this generator at its yield
            # (GeneratorExit); one that arrives during the pause between messages cancels the task.
            with self._lock:
                self.cancelled.append(request.request_id)
            raise
        finally:
            span.end()


async def start_fake_verifier(vocab_size: int, max_context: int = 512,
                              port: int = 0) -> tuple[grpc.aio.Server, FakeVerifier, int]:
    server = grpc.aio.server()
    fake = FakeVerifier(vocab_size, max_context)
    verifier_pb2_grpc.add_VerifierServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, fake, port
