"""`kvpool tenant` against a real cluster: the token goes to --token-out only (mode 0600), never to the terminal;
limits set and listed; a rotation ends the old token; a delete frees the tenant's objects; without the secret,
one line saying what to give."""

import json
import os
import stat
import subprocess
import sys

from kvpool import Client
from kvpool.errors import ForbiddenError
from kvpool.net.netutil import wait_until
from kvpool.security import auth

KVPOOL = [sys.executable, "-m", "kvpool.commands.cli"]


def kvpool(cluster, *args: str, secret: bool = True):
    env = {**os.environ, "KVPOOL_TOKEN_FILE": str(cluster.secret_file if secret else cluster.client_token_file)}
    env.pop("KVPOOL_TOKEN", None)
    return subprocess.run([*KVPOOL, *args, "--master", cluster.master_address], capture_output=True, text=True,
                          timeout=60, env=env)


def test_tenant_commands(cluster, tmp_path):
    token_file = tmp_path / "ops.token"
    made = kvpool(cluster, "tenant", "create", "ops", "--quota", "64MiB", "--reserve", "8MiB", "--quota-objects",
                  "1000", "--token-out", str(token_file))
    assert made.returncode == 0, made.stderr
    token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token.startswith(auth.TENANT_TOKEN_PREFIX) and token not in made.stdout + made.stderr
    again = kvpool(cluster, "tenant", "create", "ops", "--token-out", str(tmp_path / "other.token"))
    assert again.returncode != 0 and "exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert kvpool(cluster, "tenant", "set", "ops", "--quota", "128MiB").returncode == 0
    listed = kvpool(cluster, "tenant", "list", "--json")
    [ops] = [t for t in json.loads(listed.stdout) if t["name"] == "ops"]
    assert ops["limits"] == {"quota": str(128 << 20), "quota_dram": "0", "quota_ssd": "0", "quota_objects": "1000",
                             "reserve": str(8 << 20)}
    assert "ops" in kvpool(cluster, "tenant", "usage", "ops").stdout
    with Client(cluster.master_address, token=cluster.secret) as operator:
        nodes = [node.address for node in operator.stats().nodes]
    wait_until(lambda: cluster.takes(token, nodes), 10, what="the tenant's token to be taken")
    with Client(cluster.master_address, token=token) as tenant:
        tenant.put("k", b"v")
    rotated = kvpool(cluster, "tenant", "rotate", "ops", "--token-out", str(tmp_path / "ops2.token"))
    assert rotated.returncode == 0, rotated.stderr
    assert not cluster.takes(token, nodes)  # the old one stopped
    new = (tmp_path / "ops2.token").read_text().strip()
    wait_until(lambda: cluster.takes(new, nodes), 10, what="the new token to be taken")
    with Client(cluster.master_address, token=new) as tenant:
        assert tenant.get("k") == b"v"
    assert kvpool(cluster, "tenant", "delete", "ops").returncode == 0
    with Client(cluster.master_address, token=cluster.secret) as operator:
        assert not operator.exists("\x01ops\x01k")
    assert "ops" not in kvpool(cluster, "tenant", "list").stdout


def test_tenant_commands_need_the_secret(cluster, tmp_path):
    refused = kvpool(cluster, "tenant", "list", secret=False)
    assert refused.returncode != 0
    [line] = refused.stderr.strip().splitlines()
    assert "client token was given where the cluster secret is needed" in line, line
    with Client(cluster.master_address, token=cluster.client_token) as client:
        try:
            client.tenants("list")
            raise AssertionError("a client token listed the tenants")
        except ForbiddenError:
            pass
