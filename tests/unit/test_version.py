"""The release version: written once (kvpool/protocol/release.py, which pyproject.toml reads), semantic, the top
entry of CHANGELOG.md, printed by --version with the wire protocol, and in every server's metrics."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

import kvpool
from kvpool.protocol import wire
from kvpool.runtime.process import register_build_info, version_line

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_written_once_and_is_the_changelogs_newest():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvpool.protocol.release.VERSION"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", kvpool.__version__)
    releases = re.findall(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases[0] == kvpool.__version__ and len(releases) == len(set(releases)) >= 2


def test_every_command_says_its_version_and_wire_protocol():
    expected = f"{kvpool.__version__} (wire protocol {wire.VERSION})"
    assert version_line("kvpool-master") == f"kvpool-master {expected}"
    for command, program in (([], "kvpool"), (["master"], "kvpool-master"), (["storenode"], "kvpool-storenode")):
        out = subprocess.run([sys.executable, "-m", "kvpool.commands.cli", *command, "--version"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert out.strip() == f"{program} {expected}"


def test_servers_metrics_carry_the_build():
    registry = CollectorRegistry()
    register_build_info(registry)
    text = generate_latest(registry).decode()
    assert f'kvpool_build_info{{version="{kvpool.__version__}",wire_protocol="{wire.VERSION}"}} 1.0' in text
