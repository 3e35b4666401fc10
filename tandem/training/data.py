"""Training samples for the draft head: read a JSONL file, and complete it with the target's own
responses when a row has none.

Accepted rows (one JSON object per line):

- ``{"prompt": "text"}`` or ``{"prompt_token_ids": [1, 2, 3]}``: the target writes the response;
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the model folder's chat
  template; a final assistant message is the response, otherwise the target writes one;
- ``{"prompt": ..., "response": "text"}`` (or ``"response_token_ids"``): a completed sample.

EAGLE-3 trains on the target's *own* outputs (SpecForge regenerates datasets with the target), so
``--regenerate`` ignores given responses. Samples are cut to the target's context.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import ConfigError, TandemError
from tandem.traffic.dataset import TrafficRef
from tandem.training.progress import Progress, note


@dataclass(frozen=True)
class Sample:
    prompt: tuple[int, ...]
    response: tuple[int, ...] | None = None  # None until the target generates it
    traffic: TrafficRef | None = None  # served traffic: the target's features are stored there

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt) + list(self.response or ())


class _Text:
    """Tokenizer and chat template of the target folder, loaded only when a row needs them."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._tok = self._chat = None

    @functools.cached_property
    def vocab_size(self) -> float:
        """The target's vocabulary (unbounded for a folder with a tokenizer but no model config: nothing to check)."""
        from tandem.configs.model import ModelConfig

        try:
            return ModelConfig.from_dir(self.model_dir).vocab_size
        except TandemError:
            return math.inf

    def ids(self, values, where: str, field: str) -> list[int]:
        """A row's token-id list, each id checked against the target's vocabulary (found here, not as an index error
        after the target has loaded)."""
        ids = [int(t) for t in values]
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ConfigError(f"{where}: {field} holds {bad}, outside the target's vocabulary [0, {self.vocab_size})")
        return ids

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            from tandem.tokenizer import load_tokenizer

            self._tok = load_tokenizer(self.model_dir)
        return self._tok.encode(text, add_special_tokens=False)  # pieces joined by the data's own markers

    def render(self, messages: list[dict], where: str, add_generation_prompt: bool = True) -> str:
        if self._chat is None:
            from tandem.chat_template import ChatTemplate

            self._chat = ChatTemplate.from_model_dir(self.model_dir)
            if self._chat is None:
                raise ConfigError(f"{where}: 'messages' need a chat template, but {self.model_dir} has none")
        return self._chat.render(messages, add_generation_prompt=add_generation_prompt)


# ShareGPT's (SpecForge's) "conversations" rows: their speakers as chat roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _sharegpt(turns: list, where: str) -> list[dict]:
    try:
        return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
    except (KeyError, TypeError):
        raise ConfigError(f"{where}: 'conversations' turns need 'from' ({', '.join(SHAREGPT_ROLES)}) and 'value'") from None


def parse_row(row: dict, text: _Text, where: str, regenerate: bool = False) -> Sample:
    response = None
    if "messages" in row or "conversations" in row:
        messages = list(row["messages"]) if "messages" in row else _sharegpt(row["conversations"], where)
        answered = bool(messages) and messages[-1].get("role") == "assistant"
        head = text.render(messages[:-1] if answered else messages, where)
        if answered:
            # the final turn as the template writes it after the generation prompt: its end-of-turn token included
            # (the head learns where answers end), not the bare content
            whole = text.render(messages, where, add_generation_prompt=False)
            turn = whole[len(head):] if whole.startswith(head) else str(messages[-1].get("content", ""))
            response = text.encode(turn)
        prompt = text.encode(head)
    elif "prompt_token_ids" in row:
        prompt = text.ids(row["prompt_token_ids"], where, "prompt_token_ids")
    elif "prompt" in row:
        prompt = text.encode(str(row["prompt"]))
    else:
        raise ConfigError(f"{where}: a row needs 'prompt', 'prompt_token_ids', 'messages' or 'conversations'")
    if "response_token_ids" in row:
        response = text.ids(row["response_token_ids"], where, "response_token_ids")
    elif "response" in row:
        response = text.encode(str(row["response"]))
    if not prompt:
        raise ConfigError(f"{where}: the prompt is empty")
    return Sample(tuple(prompt), None if regenerate or response is None else tuple(response))


def _parsed(row, text: _Text, where: str, regenerate: bool) -> Sample:
    """parse_row, any malformed value of the row (a number for a row, a string for messages, a token id that is not a
    number) one line naming where it is."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row is a JSON object, got {type(row).__name__}")
    try:
        return parse_row(row, text, where, regenerate)
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, TandemError):  # (already one line: a bad id, a target folder without a tokenizer)
            raise
        raise ConfigError(f"{where}: a field of the wrong type ({type(e).__name__}: {str(e)[:120]}); rows hold 'prompt' "
                          "or 'response' text, 'prompt_token_ids' or 'response_token_ids' integer lists, or "
                          "'messages' / 'conversations' lists") from None


def read_jsonl(path: str | Path, model_dir: str, regenerate: bool = False, limit: int | None = None) -> list[Sample]:
    text = _Text(model_dir)
    samples = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e})") from None
            samples.append(_parsed(row, text, where, regenerate))
            if limit is not None and len(samples) >= limit:
                break
    if not samples:
        raise ConfigError(f"{path}: no samples")
    return samples


def fit_context(sample: Sample, context: int) -> Sample:
    """Cut to the context: the prompt keeps its end (what the response follows), the response its start.
    Served traffic already fits (the target produced it) and its stored features must stay aligned."""
    if sample.traffic is not None:
        return sample
    prompt = sample.prompt[-(context - 1) :]
    if sample.response is None:
        return Sample(prompt)
    return Sample(prompt, sample.response[: context - len(prompt)])


def complete_samples(engine, samples: list[Sample], params, chunk: int = 64, kept: Path | None = None) -> list[Sample]:
    """Generate a response with the target for every sample that lacks one (continuous batching,
    ``chunk`` prompts at a time). Sampling is seeded per prompt (``params.seed + index``). ``kept``: a file each chunk's
    responses are appended to as it completes, and read first — the responses of an interrupted run (of the same
    prompts: each line names its sample's index and prompt) are not generated again."""
    import dataclasses

    out = list(samples)
    done = _kept_responses(kept, samples) if kept is not None else {}
    for i, response in done.items():
        out[i] = Sample(samples[i].prompt, response)
    todo = [i for i, s in enumerate(samples) if s.response is None and i not in done]
    context = engine.model_config.max_position_embeddings
    bar = Progress("generate", len(todo))
    for start in range(0, len(todo), chunk):
        idx = todo[start : start + chunk]
        per = []
        for i in idx:
            room = context - len(samples[i].prompt)
            per.append(dataclasses.replace(params, max_new_tokens=max(1, min(params.max_new_tokens, room)),
                                           seed=None if params.seed is None else params.seed + i))
        results = engine.generate([list(samples[i].prompt) for i in idx], per, spec=None)
        for i, res in zip(idx, results):
            out[i] = Sample(samples[i].prompt, tuple(res.output_token_ids))
        if kept is not None:
            with open(kept, "a") as f:
                f.writelines(json.dumps({"index": i, "prompt_token_ids": list(samples[i].prompt),
                                         "response_token_ids": list(out[i].response)}) + "\n" for i in idx)
        bar.update(min(start + chunk, len(todo)), sum(len(r.output_token_ids) for r in results))
    bar.close()
    return out


def _kept_responses(path: Path, samples: list[Sample]) -> dict[int, tuple[int, ...]]:
    """complete_samples' file: index → response, where the line's prompt is still that sample's (a cut last line, as
    an interrupt leaves it, and lines of other prompts are passed over)."""
    if not path.is_file():
        return {}
    done = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            i = row["index"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if 0 <= i < len(samples) and tuple(row.get("prompt_token_ids", ())) == samples[i].prompt:
            done[i] = tuple(row["response_token_ids"])
    if done:
        note(f"reusing {len(done)} responses the target wrote before ({path})")
    return done


def save_samples(path: Path, samples: list[Sample]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for s in samples:
            row = {"prompt_token_ids": list(s.prompt), "response_token_ids": list(s.response or ())}
            if s.traffic is not None:
                row["traffic"] = [s.traffic.shard, s.traffic.index]
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def load_samples(path: Path) -> list[Sample]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Sample(tuple(r["prompt_token_ids"]), tuple(r["response_token_ids"]),
                   TrafficRef(*r["traffic"]) if "traffic" in r else None) for r in rows]


def read_traffic(folders: list[str]) -> list[Sample]:
    """Samples captured from served traffic (``python -m verifier --capture-traffic DIR``)."""
    from tandem.traffic.dataset import read_index
    from tandem.traffic.recorder import CaptureConfig

    samples = []
    for folder in folders:
        index = read_index(Path(folder))
        if not index:
            raise ConfigError(f"{folder}: no captured samples yet (a capturing verifier writes a shard every "
                              f"{CaptureConfig.shard_samples} samples or {CaptureConfig.shard_mb:g} MB of features, and the rest when it stops)")
        samples += [Sample(tuple(tokens[:plen]), tuple(tokens[plen:]), ref) for ref, tokens, plen, _ in index]
    return samples
