"""compat/mooncake_store installed as a user installs it: in a virtualenv with pip, code importing mooncake.store
gets kvpool's client and reaches a real cluster; and pip refuses to install it where a real Mooncake is."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "compat" / "mooncake_store"
USER_CODE = """
import site, sys
site.addsitedir(sys.argv[1])  # kvpool, from the suite's own environment
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", sys.argv[2]) == 0
config = ReplicateConfig()
config.replica_num = 1
assert store.put("package/key", b"through mooncake.store", config) == 0
assert store.get("package/key") == b"through mooncake.store" and store.get("package/missing") == b""
print("ok", type(store).__module__)
"""


def pip_install(venv: Path, package: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                           "--no-cache-dir", str(package)], capture_output=True, text=True, timeout=300)


def test_installed_package_answers_as_mooncake_store_and_refuses_a_real_mooncake(cluster, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    package = shutil.copytree(PACKAGE, tmp_path / "package")  # setuptools builds in the tree it is given
    installed = pip_install(venv, package)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    ran = subprocess.run([str(venv / "bin" / "python"), "-c", USER_CODE, sysconfig.get_paths()["purelib"],
                          cluster.master_address], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.split() == ["ok", "kvpool.compat.mooncake.store"]

    # What a real Mooncake wheel leaves in site-packages: its distribution's metadata.
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "mooncake_transfer_engine-0.3.13.dist-info").mkdir()
    refused = pip_install(venv, package)
    assert refused.returncode != 0
    assert "a real Mooncake is installed here" in refused.stdout + refused.stderr
