"""Bounds on sampling fields, checked by the engine and, with a 400 naming the field, by the gateway
(torch-free, so the gateway can import them)."""

MAX_LOGPROBS = 20  # top alternatives per generated token, vLLM's default --max-logprobs
MAX_REPETITION_PENALTY = 100.0  # (0, this]: far past any useful value; 1 is off
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_STOP_TOKEN_IDS = 256  # a request's stop_token_ids at most (checked at every token: a million made every step slow)
