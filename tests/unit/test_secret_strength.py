"""Secrets of at least 128 bits where one enters a server or a command (kvpool/security/auth.py: read_token,
secret_of, `kvpool up --token`), and no command printing one in clear (`kvpool config`). Library
constructors (Verifier, Credential) stay permissive: tests make impostors with short secrets."""

import pytest

from kvpool.commands import cli
from kvpool.master import main as master_main
from kvpool.security import auth
from kvpool.storenode import main as node_main

WEAK = "hunter2"
STRONG = auth.new_secret()


@pytest.mark.parametrize(("token", "ok"), [
    ("a", False), (WEAK, False), ("0123456789abcdef" * 2, True), ("0123456789abcdef0123456789abcde", False),
    ("G" * 22, True), ("G" * 21, False), (STRONG, True), (auth.client_token(WEAK), True),
    ("kvpool-client-v1:abcd", False), ("kvpool-client-v1:" + "zz" * 32, False),
])
def test_what_a_secret_must_hold(token, ok):
    assert (auth.secret_problem(token) is None) == ok


def test_a_weak_token_is_refused_where_it_is_read(tmp_path):
    path = tmp_path / "secret"
    auth.write_private(path, WEAK)
    with pytest.raises(ValueError, match=f"token file {path}: the cluster secret holds about 42 bits, fewer "
                                         "than 128: make one with `kvpool token new`"):
        auth.read_token(path, env={})
    with pytest.raises(ValueError, match="KVPOOL_TOKEN: the cluster secret holds about 42 bits"):
        auth.read_token(None, env={"KVPOOL_TOKEN": WEAK})
    with pytest.raises(ValueError, match="malformed client token"):
        auth.read_token(None, env={"KVPOOL_TOKEN": "kvpool-client-v1:00"})
    assert auth.read_token(None, env={"KVPOOL_TOKEN": STRONG}) == STRONG


@pytest.mark.parametrize("server", [master_main, node_main])
def test_servers_refuse_a_weak_secret_at_start(server, tmp_path, capsys):
    path = tmp_path / "secret"
    auth.write_private(path, WEAK)
    args = ["--etcd", "127.0.0.1:1", "--token-file", str(path)]
    with pytest.raises(SystemExit) as ended:
        server.main(args + (["--dram", "1MiB"] if server is node_main else []))
    assert ended.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "fewer than 128" in last and "kvpool token new" in last and WEAK not in last


def test_kvpool_up_refuses_a_weak_token(capsys, monkeypatch):
    monkeypatch.delenv("KVPOOL_DEBUG", raising=False)
    assert cli.main(["up", "--token", WEAK, "--nodes", "1"]) != 0
    err = capsys.readouterr().err
    assert "--token" in err and "fewer than 128" in err and WEAK not in err


def test_kvpool_config_never_prints_a_token(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOOL_UP_TOKEN", STRONG)
    (tmp_path / "empty.toml").write_text("")
    monkeypatch.setenv("KVPOOL_CONFIG", str(tmp_path / "empty.toml"))
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert STRONG not in out
    assert 'token = "(hidden)"  # $KVPOOL_UP_TOKEN' in out.splitlines()
