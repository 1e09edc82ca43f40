"""kvpool's import order (ARCHITECTURE.md, "Layers"): the layers contract in pyproject.toml holds on the tree, and
the checker reports a module that breaks it."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "pyproject.toml"
LINT_IMPORTS = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def installed_layout(dest: Path) -> Path:
    """The package laid out as installed (pyproject's package-dir puts master/ at kvpool/master/ and so on): the
    checker reads one directory tree per root package."""
    package_dirs = tomllib.loads(CONFIG.read_text())["tool"]["setuptools"]["package-dir"]
    for package, directory in sorted(package_dirs.items()):  # "kvpool" first, then the packages inside it
        shutil.copytree(ROOT / directory, dest / package.replace(".", "/"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports with the project's contracts, on `tree` (found first on the path, ahead of the installed one)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache", str(CONFIG)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def test_every_module_imports_only_its_own_layer_and_those_below(tmp_path):
    result = lint_imports(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


@pytest.mark.parametrize("module, statement, reported", [
    # the ground floor importing a program
    ("kvpool/protocol/wire.py", "from kvpool.commands import status", "kvpool.protocol.wire -> kvpool.commands.status"),
    # one layer up, through a package import
    ("kvpool/security/auth.py", "import kvpool.net.tcp_link", "kvpool.security.auth -> kvpool.net.tcp_link"),
    # two packages of one layer (master, client) must not import each other
    ("kvpool/master/nodes/repair.py", "from kvpool.client import Client", "kvpool.master.nodes.repair -> kvpool.client"),
    # inside the master: the object table knowing of node I/O
    ("kvpool/master/table/ledger.py", "from kvpool.master.nodes import node_io",
     "kvpool.master.table.ledger -> kvpool.master.nodes.node_io"),
    # inside a node: storage knowing of the transports
    ("kvpool/storenode/storage/store.py", "from kvpool.storenode.serving import ops",
     "kvpool.storenode.storage.store -> kvpool.storenode.serving.ops"),
])
def test_an_import_from_a_higher_layer_breaks_the_contract(tmp_path, module, statement, reported):
    tree = installed_layout(tmp_path)
    with open(tree / module, "a") as f:
        f.write(f"\n{statement}  # deliberately against the layers\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert "Contracts: 2 kept, 1 broken." in result.stdout
    assert reported in result.stdout


@pytest.mark.parametrize("package", ["kvpool", "kvpool/master", "kvpool/storenode"])
def test_a_module_in_no_layer_breaks_the_contract(tmp_path, package):
    """A new module directly in kvpool/, master/ or storenode/ must be given a layer (the contracts are exhaustive):
    in master/ and storenode/ only the entry points stand outside a subpackage."""
    tree = installed_layout(tmp_path)
    (tree / package / "frames.py").write_text('"""A module nobody placed."""\n')
    result = lint_imports(tree)
    assert result.returncode != 0
    assert package.replace("/", ".") + ".frames" in result.stdout


def test_tests_benchmarks_and_examples_import_the_product_as_installed():
    """`from master.objects import ...` works only where the working directory is on the path (`python -m pytest`
    from the root), not under the `pytest` script CI runs: the product is imported as kvpool.*, as installed."""
    source_dirs = {d for d in tomllib.loads(CONFIG.read_text())["tool"]["setuptools"]["package-dir"].values()
                   if d != "kvpool"}
    pattern = re.compile(r"^\s*(?:from|import)\s+(" + "|".join(sorted(source_dirs)) + r")\b[^\n]*", re.MULTILINE)
    found = [f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
             for folder in ("tests", "benchmarks", "examples") for path in sorted((ROOT / folder).rglob("*.py"))
             for match in pattern.finditer(path.read_text())]
    assert not found, "import these through kvpool (e.g. kvpool.master.table.objects):\n" + "\n".join(found)
