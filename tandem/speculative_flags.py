"""The speculative flags, defined once: the draft model, the tree's shape, SGLang's ``--speculative-algorithm`` and
vLLM's ``--speculative-config``, all resolved to one ``Speculative`` (``tandem up``, ``tandem generate``, the verifier
and the drafter take them). An EAGLE-1/2 head is refused naming both widths, as is the model's own MTP layer."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from tandem.args import DRAFT_MODEL_NAMES, NO_DRAFT, Flag, add
from tandem.errors import ConfigError

log = logging.getLogger("tandem")

# The speculative shape when no flag sets it: a chain of 3 draft steps (4 tokens with the root).
DEFAULT_NUM_STEPS = 3
DEFAULT_TOPK = 1
SPECULATIVE_ALGORITHMS = ("EAGLE3",)
SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens")

NUM_STEPS = Flag(("--speculative-num-steps",), dict(type=int, default=None,
                                                    help=f"draft tree depth (default: {DEFAULT_NUM_STEPS})"))
EAGLE_TOPK = Flag(("--speculative-eagle-topk",), dict(type=int, default=None, help="children per draft node; 1 "
                                                      f"drafts a chain (default: {DEFAULT_TOPK})"))
NUM_DRAFT_TOKENS = Flag(("--speculative-num-draft-tokens",), dict(
    type=int, default=None, help="draft tokens verified per round, the root included (default: steps + 1 for a "
                                 "chain, 2 x steps for a tree)"))
ALGORITHM = Flag(("--speculative-algorithm",), dict(
    default=None, metavar="EAGLE3", help="SGLang's switch: EAGLE3 turns speculation on (with a draft model); EAGLE "
                                         "(1/2) heads are refused: Tandem serves EAGLE-3 heads (default: on when a "
                                         "draft model is given)"))
SPEC_CONFIG = Flag(("--speculative-config",), dict(
    default=None, metavar="JSON", help="vLLM's form: '{\"method\": \"eagle3\", \"model\": DRAFT, "
                                       "\"num_speculative_tokens\": N}' = a chain of N draft steps (N + 1 tokens); "
                                       "instead of the --speculative-* flags"))
SPEC_SHAPE_FLAGS = (NUM_STEPS, EAGLE_TOPK, NUM_DRAFT_TOKENS)


def add_speculative(p: argparse.ArgumentParser, draft_names: tuple[str, ...] = DRAFT_MODEL_NAMES,
                    draft_help: str = "EAGLE-3 draft folder; enables speculative decoding") -> None:
    """The draft model (dest ``draft_model``), the tree shape, ``--speculative-algorithm`` and
    ``--speculative-config``; ``resolve_speculative`` reads them."""
    p.add_argument(*draft_names, dest="draft_model", default=None, help=draft_help)
    add(p, ALGORITHM, *SPEC_SHAPE_FLAGS, SPEC_CONFIG)


@dataclass(frozen=True)
class Speculative:
    """The draft settings every spelling resolves to."""
    draft_model: str | None
    num_steps: int = DEFAULT_NUM_STEPS
    topk: int = DEFAULT_TOPK
    num_draft_tokens: int = DEFAULT_NUM_STEPS + 1
    # --speculative-algorithm or --speculative-config asked for speculation (how it was asked: not compared)
    requested: bool = field(default=False, compare=False)
    shape_given: tuple[str, ...] = field(default=(), compare=False)  # the shape flags the command line gave

    def argv(self) -> list[str]:
        """The shape in our spelling (tandem up passes it to the services)."""
        return ["--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", str(self.topk),
                "--speculative-num-draft-tokens", str(self.num_draft_tokens)]

    def require_draft(self) -> None:
        if self.requested and self.draft_model is None:
            raise ConfigError("speculation was asked for (--speculative-algorithm / --speculative-config) without a "
                              "draft: give --speculative-draft-model-path DIR (an EAGLE-3 head)")
        if self.shape_given and self.draft_model is None:
            log.warning("%s shape%s the draft, but there is no draft model: ignored (speculation is off)",
                        " and ".join(self.shape_given), "s" if len(self.shape_given) == 1 else "")


def resolve_speculative(args: argparse.Namespace, target: str | None = None, default_draft: bool = False) -> Speculative:
    """SGLang's and vLLM's spellings of the draft settings, checked and made one; ``target`` (the target's
    folder, when known) lets a refused EAGLE-1/2 name the widths; ``default_draft``: a draft comes without being named
    (tandem up's demo pair)."""
    draft, steps, topk, tokens = args.draft_model, args.speculative_num_steps, args.speculative_eagle_topk, \
        args.speculative_num_draft_tokens
    requested = False
    if args.speculative_algorithm is not None:
        _check_method(args.speculative_algorithm, "--speculative-algorithm", target,
                      has_draft=draft is not None or default_draft)
        requested = True
    if args.speculative_config is not None:
        given = [f.names[0] for f in (ALGORITHM, *SPEC_SHAPE_FLAGS) if getattr(args, f.dest) is not None]
        given += ["--speculative-draft-model-path"] if draft is not None else []
        if given:
            raise ConfigError(f"--speculative-config and {', '.join(given)} both set the draft: give one or the other")
        draft, steps = _from_speculative_config(args.speculative_config, target)
        topk, tokens, requested = 1, steps + 1, True
    if draft is not None and draft != NO_DRAFT:
        from tandem.model_source import resolve_model

        draft = resolve_model(draft, flag="--draft-model")
    steps = DEFAULT_NUM_STEPS if steps is None else steps
    topk = DEFAULT_TOPK if topk is None else topk
    if tokens is None:
        tokens = steps + 1 if topk == 1 else 2 * steps
    given = tuple(f.names[0] for f in SPEC_SHAPE_FLAGS if getattr(args, f.dest) is not None)
    return Speculative(draft, steps, topk, tokens, requested, given)


def _from_speculative_config(raw: str, target: str | None) -> tuple[str | None, int]:
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not valid JSON ({exc}): {raw[:80]}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {raw[:80]}")
    if cfg.get("draft_tensor_parallel_size") in (1, None):  # (vLLM's EAGLE docs pass 1: the head runs on one GPU here)
        cfg.pop("draft_tensor_parallel_size", None)
    unknown = sorted(set(cfg) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"--speculative-config: {', '.join(map(repr, unknown))} not supported (Tandem takes "
                          f"{', '.join(SPECULATIVE_CONFIG_KEYS)}; trees: the --speculative-* flags)")
    _check_method(str(cfg.get("method", "")), "--speculative-config method", target)
    model, n = cfg.get("model"), cfg.get("num_speculative_tokens", DEFAULT_NUM_STEPS)
    if model is not None and not isinstance(model, str):
        raise ConfigError(f"--speculative-config model must be a folder path, got {json.dumps(model)}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"--speculative-config num_speculative_tokens must be an integer >= 1, got {json.dumps(n)}")
    return model, n


def _check_method(value: str, where: str, target: str | None, has_draft: bool = True) -> None:
    name = value.strip().upper().replace("-", "").replace("_", "")
    if name in SPECULATIVE_ALGORITHMS:
        return
    if name in ("EAGLE", "NEXTN") and not has_draft:  # (SGLang's way to run DeepSeek's own MTP layer)
        raise ConfigError(f"{where} {value} without a draft: the model's own MTP layer (DeepSeek-V3 / Kimi's "
                          "layers.<num_hidden_layers>) is not served; Tandem speculates with an EAGLE-3 head: "
                          "--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR, or no speculation")
    if name == "EAGLE":
        h = _hidden_size(target)
        one, three = (f"{h}", f"{3 * h}") if h else ("H", "3 x H")
        raise ConfigError(f"{where} {value}: EAGLE-1/2 heads draft from the target's last hidden state ({one} wide); "
                          f"Tandem serves EAGLE-3 heads, which read three target layers ({three} wide): use EAGLE3 "
                          "with an EAGLE-3 head (SpecForge / SGLang format)")
    raise ConfigError(f"{where} {value!r} is not supported: Tandem speculates with EAGLE-3 heads only (EAGLE3)")


def _hidden_size(target: str | None) -> int | None:
    try:
        raw = json.loads((Path(target) / "config.json").read_text())
    except (TypeError, OSError, ValueError):
        return None
    size = raw.get("hidden_size") or (raw.get("text_config") or {}).get("hidden_size")
    return size if isinstance(size, int) else None
