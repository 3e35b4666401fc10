"""Bounds on sampling fields that the gateway checks before the engine does (torch-free)."""

MAX_LOGPROBS = 20  # top alternatives per generated token, vLLM's default --max-logprobs
