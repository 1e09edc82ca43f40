"""The suite's tiers (tests/tiers.py, docs/testing.md): every test file lands in exactly one place tier, a folder with
no tier is refused, and the quick tier holds tests of every package."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import tiers

TESTS = tiers.TESTS
ROOT = TESTS.parent
# the product's packages, each of which the quick tier must exercise: imported by a quick test, or run by a quick
# end-to-end test's LocalCluster (masters and nodes, which keep their records in etcd through kvpool.cluster)
PACKAGES = ("master", "storenode", "client", "connectors", "protocol", "sockets", "security", "net", "cluster",
            "runtime", "sharedfs", "launch", "commands")
RUN_AS_PROCESSES = {"master", "storenode", "client", "launch", "cluster"}


def test_every_test_file_has_one_place_tier():
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 50
    places = {f.relative_to(TESTS).as_posix(): tiers.place_of(f) for f in files}
    assert set(places.values()) <= set(tiers.PLACES)
    assert places["e2e/test_benchmarks.py"] == "bench" and places["unit/test_suite_tiers.py"] == "unit"


def test_a_folder_with_no_tier_is_refused():
    with pytest.raises(tiers.NoTier, match="tests/newplace/ has no tier"):
        tiers.place_of(TESTS / "newplace" / "test_x.py")


def test_unit_tests_are_quick_unless_slow_and_others_only_when_marked():
    assert tiers.is_quick("unit", set()) and not tiers.is_quick("unit", {"slow"})
    assert not tiers.is_quick("e2e", set()) and tiers.is_quick("e2e", {"quick"})
    assert not tiers.is_quick("engines", {"slow"})


def test_pytest_selects_each_tier_by_its_marker(tmp_path):
    """Collected as the suite is: `-m quick` holds unit and end-to-end tests and no engine, multihost or GPU test
    unless marked, and each product package is exercised by some quick test."""
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-m", "quick", str(TESTS)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert listing.returncode == 0, listing.stdout[-2000:] + listing.stderr[-2000:]
    quick_files = {line.split("::", 1)[0] for line in listing.stdout.splitlines() if "::" in line}
    places = {tiers.place_of(ROOT / f) for f in quick_files}
    assert {"unit", "e2e"} <= places, places
    assert "tests/unit/test_suite_tiers.py" in quick_files
    for name in PACKAGES:
        users = [f for f in quick_files if re.search(rf"\bkvpool\.{name}\b|kvpool import {name}\b",
                                                        (ROOT / f).read_text())]
        runs_it = name in RUN_AS_PROCESSES and any(tiers.place_of(ROOT / f) == "e2e" for f in quick_files)
        assert users or runs_it, f"no quick test exercises kvpool.{name}: mark a fast test of it `quick`"
