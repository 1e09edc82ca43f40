"""Refuses to build where a real Mooncake is installed: code there imports Mooncake's own store (its store.so
shadows this package's store.py), so this package would do nothing but mislead. pip runs setup.py in the
interpreter it installs into (with build isolation too), so its site-packages are the ones looked in; uv builds
in a venv of its own, where this check cannot see the target (the package then lands shadowed and harmless)."""

import sysconfig
from pathlib import Path

from setuptools import setup


def real_mooncake() -> str | None:
    for directory in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        site = Path(directory)
        found = [*site.glob("mooncake_transfer_engine*.dist-info"), *site.glob("mooncake/store*.so"),
                 *site.glob("mooncake/engine*.so")]
        if found:
            return str(found[0])
    return None


found = real_mooncake()
if found:
    raise SystemExit(f"kvpool-mooncake-store: a real Mooncake is installed here ({found}); this package would "
                     "replace its mooncake/ and break it. Use a virtualenv without Mooncake, or import "
                     "kvpool.compat.mooncake directly.")
setup()
