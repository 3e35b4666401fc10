"""Error types whose message is meant to be shown to the user as one line."""


class TandemError(Exception):
    """Base of errors that the command line prints as ``error: <message>`` without a traceback."""


class CheckpointError(TandemError, ValueError):
    """A model folder that cannot be loaded: bad config, unsupported architecture, missing or misshaped tensor."""


class ConfigError(TandemError, ValueError):
    """An engine or request setting that cannot work (names the setting and the fix)."""


class DuplicateRequestError(ConfigError):
    """A request id that a running request holds (the running one goes on untouched)."""


class OutOfPagesError(TandemError, RuntimeError):
    """The paged KV cache has no room for what was asked."""
