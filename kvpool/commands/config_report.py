"""`kvpool config`: the settings in effect and where each came from, and the reference of every setting (made
from the commands' own parsers, so it cannot drift from them)."""

import argparse
import json
from pathlib import Path

from ..runtime import config

REFERENCE_TITLE = "# Configuration reference"
SECRET_SETTINGS = frozenset({"token"})  # settings that hold a secret: shown by where they come from, never in clear
HIDDEN = '"(hidden)"'


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))


def effective(parsers: dict[str, argparse.ArgumentParser], commands: list[str], path: Path | None) -> str:
    """The settings each command would run with from this file and the environment (flags aside)."""
    tables = config.load(path) if path else {}
    lines = []
    for name in commands:
        parser = parsers[name]
        values, sources = config.settings(parser, name, [], tables, path)
        lines.append(f"[{name}]")
        for dest, action in config.options(parser).items():
            key = dest.replace("_", "-")
            if dest in values:
                shown = HIDDEN if dest in SECRET_SETTINGS else _toml(values[dest])
                lines.append(f"{key} = {shown}  # {sources[dest]}")
            elif action.required:
                lines.append(f"# {key} = ?  # required: not set")
            elif action.default is None:
                lines.append(f"# {key} =  # unset (default)")
            else:
                lines.append(f"{key} = {_toml(action.default)}  # default")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def reference(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """Markdown: every setting of every command, its default, its environment variable and what it does."""
    out = [REFERENCE_TITLE, "",
           "Made by `kvpool config --reference` from the commands themselves; a test checks this file is what it",
           "prints. Each setting is a long option of its command; in a config file it goes in the command's table",
           f"(`[{config.SHARED}]` holds those several commands share: "
           + ", ".join(f"`{k.replace('_', '-')}`" for k in sorted(config.SHARED_KEYS)) + ").",
           "Strongest first: a flag, the environment variable, the command's table, `[cluster]`, the default.", ""]
    for name, parser in parsers.items():
        out += [f"## [{name}]: `kvpool {name}`", "", "| setting | default | environment | what it does |",
                "|---|---|---|---|"]
        for dest, action in config.options(parser).items():
            default = "required" if action.required else ("" if action.default in (None, argparse.SUPPRESS)
                                                          else f"`{_toml(action.default)}`")
            try:
                what = (action.help or "") % {**vars(action), "prog": parser.prog}
            except (KeyError, TypeError, ValueError):
                what = action.help or ""
            what = " ".join(what.replace("|", "\\|").split())
            out.append(f"| `{dest.replace('_', '-')}` | {default} | `{config.env_name(name, dest)}` | {what} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
