"""Earlier releases of kvpool, built from the repository's history for tests that mix releases
(tests/e2e/test_rolling_upgrade.py): each laid out as installed, so a process started with it first on
PYTHONPATH runs that release's code with this environment's dependencies."""

import io
import shutil
import subprocess
import tarfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The release before this one: (version, its commit; tagged v0.1.0). Its dependencies are a subset of this one's.
PREVIOUS = ("0.1.0", "c4fd7011e767b4f92a5f8193b59f769fb1340242")


def missing_history(commit: str) -> str | None:
    """Why `commit` cannot be built here (no git, or a checkout without that history), or None."""
    if shutil.which("git") is None:
        return "git is not installed"
    probe = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                           capture_output=True, timeout=30)
    return None if probe.returncode == 0 else f"this checkout has no commit {commit} (a shallow clone?)"


def build(commit: str, dest: Path) -> Path:
    """The tree of `commit` laid out as its pyproject installs it (master/ at kvpool/master/ and so on) under
    dest/site; returns that directory, to put first on PYTHONPATH."""
    source, site = dest / "source", dest / "site"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit],
                             capture_output=True, check=True, timeout=120).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    package_dirs = tomllib.loads((source / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, directory in sorted(package_dirs.items()):  # "kvpool" first, then the packages inside it
        shutil.copytree(source / directory, site / package.replace(".", "/"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "tests"))
    return site
