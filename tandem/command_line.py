"""How a Tandem command line is read, for every CLI (``tandem``, ``python -m verifier|drafter|gateway``): one-line
errors that point to ``--help``, vLLM's ``--config FILE`` expanded into flags, another service's flags passed through
``--<service>-args`` as one string, and an unknown flag refused by the subcommand that got it. The flags themselves are
defined in tandem.args."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tandem.errors import ConfigError


NEGATABLE = "negatable"  # _arity's word for a switch with a --no- form


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line and a pointer to ``--help``: a refused flag of ``tandem up`` came
    after its whole usage block (~50 lines) otherwise. Flags are taken only spelled whole: argparse's abbreviations took
    ``--cuda-graph-m 8`` for ``--cuda-graph-max-bs`` and would take a mistyped flag for whichever one it begins."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after each flag's help, except where the help already says its default or there is
    none to show (None, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # (by identity: a default of 0 is one to show, though 0 == False)
        if _STATES_DEFAULT.search(text) or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


_STATES_DEFAULT = re.compile(r"\(default|default:|%\(default\)")  # a help that names its default ("sampling defaults" does not)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None,
               subcommand: bool = False) -> argparse.Namespace:
    """``parser.parse_args`` with ``--config FILE`` expanded first: the file's flags go before the command
    line's (after a ``subcommand``), so what the command line says wins."""
    import sys

    # (glued first: a service's own --config passed through --verifier-args is not tandem up's)
    argv = _glue_flag_strings(list(sys.argv[1:] if argv is None else argv))
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        path = pre.parse_known_args(argv)[0].config
        # after the subcommand: the first word that is not an option (the top level's options take no value)
        at = next((i + 1 for i, a in enumerate(argv) if not a.startswith("-")), 0) if subcommand else 0
        try:
            argv = argv[:at] + config_argv(path, _arity(parser)) + argv[at:]
        except ConfigError as e:
            parser.error(str(e))
    args, unknown = parser.parse_known_args(_glue_flag_strings(argv))  # (again: a config file's words too)
    if unknown:  # refused by the subcommand's parser, which names its own --help (and may say where such flags go)
        refusing = _subparser(parser, getattr(args, "command", None)) if subcommand else parser
        hint = getattr(refusing, "unknown_hint", "")
        refusing.error(f"unrecognized arguments: {' '.join(unknown)}" + (f"; {hint}" if hint else ""))
    return args


def _arity(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Each flag of ``parser`` and its subcommands' by what it takes: 0 (a switch), NEGATABLE (a switch with a ``--no-``
    form, argparse.BooleanOptionalAction), None (one value), "append" (one value a time, repeatable), or argparse's
    nargs; a flag two subcommands take differently is left out (argparse then judges its words)."""
    found: dict[str, object] = {}
    clashing: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for flag, nargs in _arity(sub).items():
                    if found.setdefault(flag, nargs) != nargs:
                        clashing.add(flag)
            continue
        for flag in action.option_strings:
            if flag.startswith("--") and not flag.startswith("--no-"):
                nargs = (NEGATABLE if isinstance(action, argparse.BooleanOptionalAction)
                         else "append" if isinstance(action, argparse._AppendAction) else action.nargs)
                if found.setdefault(flag, nargs) != nargs:
                    clashing.add(flag)
    return {flag: nargs for flag, nargs in found.items() if flag not in clashing}


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def _glue_flag_strings(argv: list[str]) -> list[str]:
    """``--verifier-args '--disable-log-stats'`` as ``--verifier-args=--disable-log-stats``: argparse takes a value
    that starts with a dash for an option of its own, and these options' values are other services' flags."""
    out = []
    for word in argv:
        if out and out[-1].startswith("--") and out[-1].endswith("-args") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def config_argv(path: str, arity: dict[str, object] | None = None) -> list[str]:
    """A config file's flags as command-line words (true: the flag alone; false: left out, or its ``--no-`` form for a
    NEGATABLE flag of ``arity``, whose default may be on; a list: its values after the flag; an object: as JSON, e.g.
    --speculative-config). With ``arity`` (``_arity``'s), a switch given other than true or false, a list for a flag of
    one value, and a flag given twice (``kv-pages`` and ``kv_pages``) are refused by key: as words they would read as
    other arguments (a switch's ``yes`` as the model)."""
    text = Path(path).read_text() if Path(path).is_file() else None
    if text is None:
        raise ConfigError(f"--config {path}: no such file")
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError
        raise ConfigError(f"--config {path}: not valid {'JSON' if path.endswith('.json') else 'YAML'} ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: must map flag names to values")
    words: list[str] = []
    seen: dict[str, str] = {}
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            raise ConfigError(f"--config {path}: a config file cannot name another")
        if flag in seen:
            raise ConfigError(f"--config {path}: {key} and {seen[flag]} are the same flag ({flag}); give it once")
        seen[flag] = str(key)
        takes = (arity or {}).get(flag, "?")
        if takes in (0, NEGATABLE) and not isinstance(value, bool) and value is not None:
            raise ConfigError(f"--config {path}: {key} is a switch: true or false, got {json.dumps(value)}")
        if takes is None and isinstance(value, list):
            raise ConfigError(f"--config {path}: {key} takes one value, got a list {json.dumps(value)[:80]}")
        if value is True:
            words.append(flag)
        elif value is False and takes == NEGATABLE:
            words.append("--no-" + flag[2:])
        elif value is False or value is None:
            continue
        elif isinstance(value, list) and takes == "append":  # (--traffic A --traffic B)
            words += [word for item in value for word in (flag, str(item))]
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, str(value)]
    return words
