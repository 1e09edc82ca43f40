"""The blocking Client and the master's control port on every other Python at hand (3.12, 3.13, ...): they step
asyncio code by hand (kvpool/runtime/coroutine_driver.py), which a Python release may break. Each interpreter
runs other_python_client.py: a cluster of its own processes, the Client's calls on it.

The interpreters: $KVPOOL_TEST_PYTHONS (python executables of venvs with this checkout installed with its test
extra, separated by os.pathsep), else every .venv-3*/bin/python at the checkout's root of a Python other than this
one, e.g. made with
    uv venv .venv-313 -p python3.13 && uv pip install -p .venv-313/bin/python -e '.[test]'
None found (as on CI, which runs one Python): skipped, saying which Pythons this machine has without such a venv."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("other_python_client.py")
PYENV = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def _version(python: Path) -> str:
    """"3.12" for a venv's python, from its pyvenv.cfg (no process started at collection)."""
    cfg = python.parent.parent / "pyvenv.cfg"
    for line in cfg.read_text().splitlines() if cfg.exists() else ():
        name, _, value = line.partition("=")
        if name.strip() in ("version", "version_info"):
            return ".".join(value.strip().split(".")[:2])
    return "?"


def _interpreters() -> list:
    named = os.environ.get("KVPOOL_TEST_PYTHONS")
    if named:
        return [pytest.param(Path(p), id=Path(p).parent.parent.name) for p in named.split(os.pathsep) if p]
    this = f"{sys.version_info[0]}.{sys.version_info[1]}"
    found = [p for p in sorted(ROOT.glob(".venv-3*/bin/python")) if _version(p) != this]  # not .venv-vllm ...
    if found:
        return [pytest.param(p, id=_version(p)) for p in found]
    others = sorted(p.name for p in PYENV.glob("3.1[1-9]*") if not p.name.startswith(this + "."))
    reason = "no venv of another Python with kvpool: set KVPOOL_TEST_PYTHONS or make .venv-3XX at the checkout's root"
    if others:
        reason += f" (this machine has Python {', '.join(others)} in {PYENV})"
    return [pytest.param(None, id="none", marks=pytest.mark.skip(reason=reason))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("python", _interpreters())
def test_the_blocking_client_runs_on_another_python(python, tmp_path):
    ran = subprocess.run([str(python), str(SCRIPT), str(tmp_path / "cluster")], cwd=SCRIPT.parent,
                         capture_output=True, text=True, timeout=150)
    assert ran.returncode == 0, f"{python}:\n{ran.stdout}\n{ran.stderr[-6000:]}"
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    assert Path(report["kvpool"]).resolve().is_relative_to(ROOT), \
        f"{python} runs kvpool from {report['kvpool']}, not this checkout ({ROOT})"
    assert _version(python) in ("?", ".".join(report["python"].split(".")[:2]))
    assert report["by_hand_loop_runs"] == 0  # the calls stepped by hand ran no event loop there either
