"""The suite's tiers (docs/testing.md): where each test runs and how long it may take, told by pytest markers.

Every test is in exactly one *place* tier, given by its file's folder (tests/conftest.py marks it at collection):
`unit`, `e2e`, `bench`, `engines`, `multihost`, `compose` or `gpu`. A file in a folder no tier names is refused at collection,
so a new folder is given a tier before its tests run. `quick` is a selection across them for a developer changing
one module (`pytest -m quick`, a few minutes on 2 cores): every unit test not marked `slow`, and the end-to-end
tests marked `quick` where they are written (the fastest ones, chosen so every package has tests in the tier).
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parent

# folder under tests/ -> its place tier; a file named here overrides its folder's tier
FOLDERS = {"unit": "unit", "e2e": "e2e", "engines": "engines", "multihost": "multihost", "compose": "compose",
           "gpu": "gpu"}
FILES = {"e2e/test_benchmarks.py": "bench"}  # the benchmarks' short runs, each a subprocess of its own
PLACES = ("unit", "e2e", "bench", "engines", "multihost", "compose", "gpu")
# what each tier needs beyond the test extra (shown by `pytest --markers`)
NEEDS = {
    "unit": "nothing: pure logic and in-process parts, no servers",
    "e2e": "real etcd, master and node processes on 127.0.0.1",
    "bench": "the benchmarks' short runs, each in a subprocess (a cluster of its own)",
    "engines": "vLLM, LMCache, SGLang and transformers in venvs of their own, built from PyPI on first use",
    "multihost": "root: network namespaces joined by a bridge, a host each",
    "compose": "root, dockerd, docker-compose and debootstrap: a Docker engine of the test's own, the image built here",
    "gpu": "CUDA (skipped without)",
    "quick": "a selection across the tiers that answers within a few minutes (`pytest -m quick`)",
    "slow": "a unit test left out of the quick tier",
}


class NoTier(Exception):
    pass


def place_of(path: Path) -> str:
    """The place tier of the test file at `path` (NoTier when its folder has none)."""
    relative = Path(path).resolve().relative_to(TESTS).as_posix()
    if relative in FILES:
        return FILES[relative]
    folder = relative.split("/", 1)[0]
    if folder not in FOLDERS:
        raise NoTier(f"{relative}: tests/{folder}/ has no tier; name it in tests/tiers.py FOLDERS")
    return FOLDERS[folder]


def is_quick(place: str, marks: set) -> bool:
    """Whether a test of `place` with marker names `marks` is in the quick tier."""
    if place == "unit":
        return "slow" not in marks
    return "quick" in marks
