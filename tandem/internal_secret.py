"""The shared secret of the internal plane (docs/architecture.md, "Contracts"): the verifier↔drafter Rounds
stream and the drafter's Reload carry it in gRPC metadata, and so do the gateway's calls to the verifier
(Generate, GetModelInfo); the drafter and the verifier refuse calls without it (UNAUTHENTICATED) — the verifier's
port is no way around the gateway's API key.

``tandem up`` generates one per stack and hands it to its three services as a file only its user can read
(``--internal-secret-file``, tandem/stack_secret.py); compose passes it as an environment variable; the file flag
takes a Docker/Kubernetes secret too. Torch-free: the launcher and the services use it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets

from tandem.errors import ConfigError

ENV = "TANDEM_INTERNAL_SECRET"
METADATA_KEY = "x-tandem-internal-secret"  # gRPC metadata keys are lower case
MIN_LENGTH = 16  # characters: a guessable secret is no secret


def generate() -> str:
    return secrets.token_hex(32)


def load(path: str | None = None) -> str | None:
    """The secret from ``path`` when given (whitespace around it stripped), else from $TANDEM_INTERNAL_SECRET;
    None when neither is set. ConfigError for an unreadable file or a secret too short to mean anything."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
        except OSError as e:
            raise ConfigError(f"--internal-secret-file {path}: {e.strerror}") from None
        where = f"--internal-secret-file {path}"
    else:
        value = os.environ.get(ENV, "").strip()
        where = f"${ENV}"
        if not value:
            return None
    if len(value) < MIN_LENGTH:
        raise ConfigError(f"{where}: the internal secret must be at least {MIN_LENGTH} characters "
                          f"(tandem up generates one; e.g. `openssl rand -hex 32`)")
    return value


def load_for(path: str | None, host: str, service: str, peer: str) -> str | None:
    """``load`` for a service binding ``host``: without a secret only a loopback address may be bound, or its port
    would be an open internal plane (ConfigError naming ``service`` and the ``peer`` that must share the secret)."""
    secret = load(path)
    if secret is None and not is_loopback(host):
        raise ConfigError(f"--host {host} is not a loopback address: {service}'s port would be an open internal plane; "
                          f"set ${ENV} (or --internal-secret-file) on {service} and {peer}")
    return secret


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """What a caller adds to its calls' metadata."""
    return ((METADATA_KEY, secret),) if secret else ()


def presented(invocation_metadata) -> str:
    """The secret a call presented ('' if none)."""
    for key, value in invocation_metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


def matches(expected: str | None, invocation_metadata) -> bool:
    """Whether a call may proceed: always when no secret is configured, else a constant-time comparison."""
    if not expected:
        return True
    return hmac.compare_digest(presented(invocation_metadata).encode(), expected.encode())


def log_refused(refusals, peer: str) -> None:
    """A call refused for the secret, in the log (``refusals``: the service's tandem.log_limit.LimitedLog: anyone who
    reaches the port could otherwise write a line per call)."""
    refusals.warning(("refused",), "refused a call without the internal secret from %s", peer)
