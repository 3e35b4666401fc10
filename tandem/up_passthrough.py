"""What `tandem up` passes to a service through ``--verifier-args``, ``--drafter-args`` or ``--gateway-args`` must not
set what the launcher sets itself: a gateway told another ``--port`` there served on it while the launcher waited for
the port it had given, and gave up after 600 s. Such a flag is refused before anything starts, naming the launcher's
own flag where there is one. Torch-free."""

from __future__ import annotations

import shlex

from tandem.command_line import config_argv
from tandem.errors import ConfigError

# per service: its flag -> tandem up's flag that sets it (None: tandem up wires it itself)
_TARGET = dict.fromkeys(("--model", "--model-path"), "--model")
_DRAFT = dict.fromkeys(("--draft-model", "--speculative-draft-model-path"), "--draft-model")
OWNED: dict[str, dict[str, str | None]] = {
    "gateway": {**_TARGET, "--model-dir": "--model", "--port": "--port", "--grpc-port": "--grpc-port",
                "--host": "--host", "--api-key": "--api-key", "--verifier": None, "--internal-secret-file": None,
                "--verifier-metrics-url": "--metrics-port", "--drafter-metrics-url": "--drafter-metrics-port"},
    "verifier": {**_TARGET, **_DRAFT, "--port": "--verifier-port", "--metrics-port": "--metrics-port",
                 "--drafter": "--drafter", "--host": None, "--internal-secret-file": None},
    "drafter": {**_DRAFT, "--model": "--draft-model", "--target-model": "--model", "--port": "--drafter-port",
                "--metrics-port": "--drafter-metrics-port", "--host": None, "--internal-secret-file": None},
}


def passthrough_words(service: str, text: str) -> list[str]:
    """``service``'s pass-through flags (``--{service}-args``, one shell-quoted string) as words, checked: unbalanced
    quotes, or a flag that tandem up sets (an abbreviation argparse would take for it counts), are a ConfigError."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"--{service}-args: {str(e).lower()} in {text!r}") from None
    owned, checked = OWNED[service], list(words)
    for i, word in enumerate(words):  # (a config file passed through is read by the service: its flags count too)
        if word == "--config" and i + 1 < len(words):
            checked += config_argv(words[i + 1])
        elif word.startswith("--config="):
            checked += config_argv(word.split("=", 1)[1])
    for word in checked:
        given = word.split("=", 1)[0]
        if not given.startswith("--") or given == "--":
            continue
        hit = given if given in owned else next((flag for flag in owned if flag.startswith(given)), None)
        if hit is not None:
            ours = owned[hit]
            instead = f": give tandem up {ours}" if ours is not None else ""
            raise ConfigError(f"--{service}-args: {given} is set by tandem up{instead}")
    return words
