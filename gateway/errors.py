"""One error type for everything the gateway refuses, and its two faces: an OpenAI error body with
an HTTP status, and a gRPC status code. Upstream (verifier) statuses are translated here, so both
front ends answer the same failure the same way."""

from __future__ import annotations

import logging

import grpc

from tandem.log_limit import LimitedLog

log = logging.getLogger("gateway.errors")

# HTTP status → (OpenAI-style error type, gRPC code). Types follow vLLM's ErrorResponse.
_KINDS: dict[int, tuple[str, grpc.StatusCode]] = {
    400: ("BadRequestError", grpc.StatusCode.INVALID_ARGUMENT),
    401: ("AuthenticationError", grpc.StatusCode.UNAUTHENTICATED),
    403: ("PermissionDeniedError", grpc.StatusCode.PERMISSION_DENIED),  # (the OpenAI client's class names)
    404: ("NotFoundError", grpc.StatusCode.NOT_FOUND),
    405: ("MethodNotAllowedError", grpc.StatusCode.UNIMPLEMENTED),
    408: ("RequestTimeoutError", grpc.StatusCode.DEADLINE_EXCEEDED),
    413: ("RequestTooLargeError", grpc.StatusCode.INVALID_ARGUMENT),
    415: ("UnsupportedMediaTypeError", grpc.StatusCode.INVALID_ARGUMENT),
    429: ("RateLimitError", grpc.StatusCode.RESOURCE_EXHAUSTED),
    499: ("ClientClosedRequest", grpc.StatusCode.CANCELLED),
    500: ("InternalServerError", grpc.StatusCode.INTERNAL),
    503: ("ServiceUnavailableError", grpc.StatusCode.UNAVAILABLE),
    504: ("TimeoutError", grpc.StatusCode.DEADLINE_EXCEEDED),
}

# The verifier's status → the HTTP status we answer with. INVALID_ARGUMENT carries a message meant
# for the user (e.g. a prompt longer than the context, which only the verifier can check exactly).
_FROM_UPSTREAM: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 503,  # the verifier dropped the call (draining, restarting)
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


RETRY_AFTER_S = 1  # a 429's or 503's Retry-After: a slot frees or a restarted verifier serves within seconds


class GatewayError(Exception):
    """A request the gateway answers with an error. ``param`` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def type(self) -> str:
        return _KINDS.get(self.status, _KINDS[400 if self.status < 500 else 500])[0]

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _KINDS.get(self.status, (None, grpc.StatusCode.UNKNOWN))[1]

    def headers(self) -> dict[str, str]:
        """HTTP headers of the answer: ``Retry-After`` on the retryable statuses (too many requests, unavailable)."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else {}

    def body(self) -> dict:
        """The OpenAI error shape; ``code`` is the HTTP status, as vLLM sends it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad_request(param: str, problem: str) -> GatewayError:
    """400 whose message starts with the field name, so a user sees at once what to fix."""
    return GatewayError(400, f"{param}: {problem}", param=param)


# What a client sees of a failure that is ours, not theirs: never an exception's text, an internal
# address or a gRPC core message (those go to the log).
INTERNAL_ERROR = "internal server error"
UNAVAILABLE = "the model server is not available right now; retry shortly"
SHUTTING_DOWN = "the server is shutting down and cut this generation short; retry the request"
_GENERIC = {500: INTERNAL_ERROR, 503: UNAVAILABLE, 504: "the model server did not answer in time"}



def from_upstream(err: grpc.aio.AioRpcError, verifier: str) -> GatewayError:
    code = err.code()
    status = _FROM_UPSTREAM.get(code, 500)
    details = err.details() or code.name
    if code == grpc.StatusCode.OUT_OF_RANGE:  # the verifier's "larger than the whole KV cache": never retry
        return bad_request("prompt", details)
    if status == 400 or status == 404:
        return GatewayError(status, details)  # already phrased for the user by the verifier
    if status == 429:
        return GatewayError(429, f"the server is at capacity, retry later ({details})")
    _failures.warning((verifier, code.name), "verifier at %s failed a request: %s: %s", verifier, code.name, details)
    return GatewayError(status, _GENERIC.get(status, INTERNAL_ERROR))


# (a dead verifier failed each request in a line of its own: thousands a second at production rates)
_failures = LimitedLog(log)
