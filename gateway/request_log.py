"""One log line per finished generation (``--log-requests``), as SGLang's ``--log-requests-level``: 0 the
request's numbers (tokens, finish reason, time to first token, end to end, accept length), 1 also its
sampling settings, 2 also the prompt's text and the output text, each cut to
``TEXT_LIMIT`` characters. Off by default: prompts and outputs can be private."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.request import GenerationRequest

log = logging.getLogger("gateway.requests")
TEXT_LIMIT = 2048  # characters of the prompt and of the output at level 2


@dataclass(frozen=True)
class RequestLog:
    level: int = 0

    @property
    def keeps_text(self) -> bool:
        return self.level >= 2

    def finished(self, request: GenerationRequest, reason: str, prompt_tokens: int, completion_tokens: int,
                 ttft_s: float | None, e2e_s: float, accept_length: float | None, prompt_text: str = "",
                 output_text: str = "", trace_id: str = "", cause: str = "") -> None:
        """``trace_id``: the request's trace (32 hex digits) when it is traced, to find its spans from the line;
        ``cause``: what failed, for a generation that ended in an error."""
        line = (f"request {request.request_id} {reason}: prompt {prompt_tokens} tokens, completion "
                f"{completion_tokens} tokens, ttft {'-' if ttft_s is None else f'{1e3 * ttft_s:.0f} ms'}, "
                f"e2e {1e3 * e2e_s:.0f} ms, accept len {'-' if accept_length is None else f'{accept_length:.2f}'}")
        if cause:
            line += f", cause {cause}"
        if trace_id:
            line += f", trace {trace_id}"
        if self.level >= 1:
            line += (f"; temperature {request.temperature:g}, top_p {request.top_p:g}, top_k {request.top_k}, "
                     f"max_tokens {request.max_tokens}, stop strings {len(request.stop)}")
        if self.level >= 2:
            line += f"; prompt {_cut(prompt_text)!r}; output {_cut(output_text)!r}"
        log.info(line)


def _cut(text: str) -> str:
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + f"... ({len(text) - TEXT_LIMIT} more)"
