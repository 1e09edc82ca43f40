"""One config file for every component, with environment overrides and flags over both.

The file is TOML (read with the standard library's tomllib). A table per command holds that command's long
options, under the option's name with or without dashes:

    [cluster]               # for every command that has the option (etcd, cluster, token-file, tls-dir,
                            # allow-etcd-without-auth, ...)
    etcd = "etcd:2379"
    [master]
    put-timeout = 30
    [storenode]
    dram = "4GiB"
    high-watermark = 0.95

Where a setting comes from, strongest first: a command-line flag; KVPOOL_<COMMAND>_<OPTION> in the environment
(KVPOOL_STORENODE_DRAM=8GiB; KVPOOL_CLUSTER_<OPTION> for [cluster]); the command's table; [cluster]; the built-in
default. The file is named by --config or KVPOOL_CONFIG. A key no command knows, or a value its option refuses
(a size without a unit it knows, a word where a number goes), stops the command before it starts, naming the key.
`kvpool config` prints the settings in effect and where each came from.
"""

import argparse
import os
import sys
import tomllib
from pathlib import Path

CONFIG_ENV = "KVPOOL_CONFIG"
SHARED = "cluster"  # the table whose keys go to every command that has the option
# What [cluster] may hold (a test checks each is some command's option).
SHARED_KEYS = frozenset({"etcd", "cluster", "master", "token_file", "tls_dir", "host", "metrics_port",
                         "allow_etcd_without_auth"})
COMMANDS = ("master", "storenode", "up", "router")
_NOT_SETTINGS = {"help", "config", "version"}


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the file or variable, the table and the key."""


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help=f"settings from this TOML file (default: ${CONFIG_ENV}); flags and "
                             f"KVPOOL_<COMMAND>_<OPTION> variables override it")


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The settings a parser takes: destination name -> its option."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in _NOT_SETTINGS}


def env_name(command: str, dest: str) -> str:
    return f"KVPOOL_{command.upper()}_{dest.upper()}"


def config_path(argv: list[str]) -> Path | None:
    """--config FILE / --config=FILE from argv, else $KVPOOL_CONFIG, else None."""
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if word.startswith("--config="):
            return Path(word.split("=", 1)[1])
    named = os.environ.get(CONFIG_ENV)
    return Path(named) if named else None


def load(path: Path) -> dict:
    """The file's tables; ConfigError for a file that cannot be read or is not TOML, or an unknown table."""
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for name, table in tables.items():
        if name not in (SHARED, *COMMANDS) or not isinstance(table, dict):
            raise ConfigError(f"{path}: [{name}] is not a table kvpool reads (it reads [{SHARED}], "
                              f"{', '.join(f'[{c}]' for c in COMMANDS)})")
    return tables


def convert(action: argparse.Action, value, where: str):
    """A file or environment value as the option would take it from the command line."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            value = value.strip().lower() in ("1", "true", "yes", "on")
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false, not {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [part for part in str(value).split(",") if part]
        return [convert_one(action, item, where) for item in values]
    return convert_one(action, value, where)


def convert_one(action: argparse.Action, value, where: str):
    if isinstance(value, (bool, dict, list)):
        raise ConfigError(f"{where}: expected a single {action.metavar or 'value'}, not {value!r}")
    text = str(value)
    try:
        result = action.type(text) if action.type else text
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if action.choices is not None and result not in action.choices:
        raise ConfigError(f"{where}: {result!r} is not one of {', '.join(map(str, action.choices))}")
    return result


def settings(parser: argparse.ArgumentParser, command: str, argv: list[str],
             tables: dict | None = None, path: Path | None = None) -> tuple[dict, dict]:
    """(values, sources) the file and the environment give this command's options, before flags."""
    known = options(parser)
    values, sources = {}, {}
    tables = tables or {}
    for table in (SHARED, command):
        for key, value in tables.get(table, {}).items():
            dest = key.replace("-", "_")
            where = f"{path} [{table}] {key}"
            if table == SHARED and dest not in SHARED_KEYS:
                raise ConfigError(f"{where}: not a shared setting (the [{SHARED}] table takes "
                                  f"{', '.join(sorted(k.replace('_', '-') for k in SHARED_KEYS))})")
            if dest not in known:
                if table == SHARED:
                    continue  # for the commands that have it
                raise ConfigError(f"{where}: no such setting (see `kvpool {command} --help`)")
            values[dest] = convert(known[dest], value, where)
            sources[dest] = f"{path} [{table}]"
    for table in (SHARED, command):
        for dest, action in known.items():
            if table == SHARED and dest not in SHARED_KEYS:
                continue
            name = env_name(table, dest)
            if name in os.environ:
                values[dest] = convert(action, os.environ[name], name)
                sources[dest] = f"${name}"
    return values, sources


def resolve(parser: argparse.ArgumentParser, command: str, argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """Parse argv over the file's and the environment's settings; (args, where each setting came from). A bad
    setting is reported as parser.error does (exit status 2), naming it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    path = config_path(argv)
    try:
        tables = load(path) if path else {}
        values, sources = settings(parser, command, argv, tables, path)
    except ConfigError as exc:
        parser.error(str(exc))
    known = options(parser)
    for dest in values:
        known[dest].required = False  # given by the file or the environment
    parser.set_defaults(**values)
    args = parser.parse_args(argv)
    for dest in _flags_given(parser, argv):
        sources[dest] = "flag"
    for dest in known:
        sources.setdefault(dest, "default")
    return args, sources


def _flags_given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options argv itself sets (parsed once more with nothing defaulted)."""
    saved = [(a, a.default, a.required) for a in parser._actions]
    defaults, parser._defaults = parser._defaults, {}  # set_defaults keeps them here too
    try:
        for action in parser._actions:
            action.default, action.required = argparse.SUPPRESS, False
        given, _ = parser.parse_known_args(argv)
    finally:
        parser._defaults = defaults
        for action, default, required in saved:
            action.default, action.required = default, required
    return set(vars(given)) - _NOT_SETTINGS
