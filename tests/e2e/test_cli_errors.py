"""A `kvpool` command that fails ends with one line on stderr naming the cause and the fix, and a non-zero
exit; the traceback only with --debug or KVPOOL_DEBUG=1. Run as a user would: real processes, a real
cluster, addresses where nothing answers."""

import os
import signal
import socket
import subprocess
import sys

import pytest

KVPOOL = [sys.executable, "-m", "kvpool.commands.cli"]
NAMESPACE = "kv/m/bf16/paged/bs16/heads-8/rank0of1/"


def _env(**extra: str) -> dict:
    """This process's environment without any credential or CA, plus `extra`."""
    unset = ("KVPOOL_TOKEN", "KVPOOL_TOKEN_FILE", "KVPOOL_TLS_CA", "KVPOOL_DEBUG")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return {**env, **extra}


def _fails(*args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    """Run `kvpool ARGS`; check it failed with one plain line last on stderr; return the result."""
    result = subprocess.run([*KVPOOL, *args], capture_output=True, text=True, timeout=timeout,
                            env=_env() if env is None else env)
    assert result.returncode not in (0, None), result
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip(), result
    return result


def _last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


def _says(result: subprocess.CompletedProcess, command: str, *words: str) -> None:
    line = _last_line(result)
    assert line.startswith(f"kvpool {command}: "), result.stderr[-3000:]
    for word in words:
        assert word in line, (word, result.stderr[-3000:])


@pytest.fixture
def dead_port() -> int:
    """A port on 127.0.0.1 where nothing listens (just freed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _secret_file(tmp_path, text: str):
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_status_without_the_client_token_says_to_export_it(cluster):
    result = _fails("status", "--master", cluster.master_address)
    _says(result, "status", "credential", "KVPOOL_TOKEN_FILE", "kvpool up")


def test_status_found_through_etcd_without_a_token_says_to_export_it(cluster):
    result = _fails("status", "--etcd", cluster.etcd_endpoint)
    _says(result, "status", "credential", "KVPOOL_TOKEN_FILE", cluster.etcd_endpoint)


def test_status_with_a_wrong_token_says_which_token_to_use(cluster, tmp_path):
    from kvpool.security import auth

    wrong = _secret_file(tmp_path, auth.client_token(auth.new_secret()))
    result = _fails("status", "--master", cluster.master_address, "--token-file", wrong)
    _says(result, "status", "refuses the token", "client token", "KVPOOL_TOKEN_FILE")


def test_status_against_a_dead_master_names_the_address_and_what_to_do(dead_port):
    result = _fails("status", "--master", f"127.0.0.1:{dead_port}")
    _says(result, "status", f"no master answers at 127.0.0.1:{dead_port}", "kvpool up", "--master HOST:PORT")


def test_status_against_a_dead_etcd_names_the_address_and_what_to_do(dead_port):
    result = _fails("status", "--etcd", f"127.0.0.1:{dead_port}")
    _says(result, "status", f"no etcd answers at 127.0.0.1:{dead_port}", "--etcd HOST:PORT")


def test_status_without_any_address_says_which_to_give():
    _says(_fails("status"), "status", "--master HOST:PORT", "--etcd HOST:PORT")


def test_an_unreadable_token_file_is_named(tmp_path, dead_port):
    result = _fails("status", "--master", f"127.0.0.1:{dead_port}", "--token-file", str(tmp_path / "none"))
    _says(result, "status", str(tmp_path / "none"), "No such file")


@pytest.mark.parametrize("credential", ["none", "wrong"])
def test_bench_checks_it_may_use_the_cluster_before_its_baseline_run(cluster, tmp_path, credential):
    from kvpool.security import auth

    args = ["--token-file", _secret_file(tmp_path, auth.client_token(auth.new_secret()))] \
        if credential == "wrong" else []
    result = _fails("bench", "--master", cluster.master_address, "--sizes", "64KiB", "--seconds", "0.1", *args)
    assert "baselines" not in result.stderr and result.stdout == "", result.stderr[-3000:]
    _says(result, "bench", "KVPOOL_TOKEN_FILE")


def test_bench_against_a_dead_master_fails_before_its_baseline_run(dead_port):
    result = _fails("bench", "--master", f"127.0.0.1:{dead_port}", "--sizes", "64KiB", "--seconds", "0.1")
    assert "baselines" not in result.stderr and result.stdout == "", result.stderr[-3000:]
    _says(result, "bench", f"no master answers at 127.0.0.1:{dead_port}")


def test_drain_against_a_dead_master_names_it(dead_port):
    _says(_fails("drain", "node-0", "--master", f"127.0.0.1:{dead_port}"), "drain",
          f"no master answers at 127.0.0.1:{dead_port}", "kvpool up")


def test_drain_of_an_unknown_node_keeps_the_masters_message(cluster):
    result = _fails("drain", "node-9", "--master", cluster.master_address,
                    env=_env(KVPOOL_TOKEN_FILE=str(cluster.secret_file)))
    _says(result, "drain", "no storage node 'node-9'")


def test_drain_with_the_client_token_is_refused_naming_the_secret(cluster):
    result = _fails("drain", "node-0", "--master", cluster.master_address,
                    env=_env(KVPOOL_TOKEN_FILE=str(cluster.client_token_file)))
    _says(result, "drain", "operator's call", "cluster secret")


def test_router_without_the_client_token_fails_instead_of_retrying_forever(cluster):
    result = _fails("router", "--engine", "a=", "--namespace", NAMESPACE, "--master", cluster.master_address,
                    "--port", "0", timeout=60)
    _says(result, "router", "credential", "KVPOOL_TOKEN_FILE")


def test_router_against_a_dead_master_fails_instead_of_retrying_forever(dead_port):
    result = _fails("router", "--engine", "a=", "--namespace", NAMESPACE, "--master", f"127.0.0.1:{dead_port}",
                    "--port", "0", timeout=60)
    _says(result, "router", f"no master answers at 127.0.0.1:{dead_port}")


def test_etcd_auth_against_a_dead_etcd_names_it(tmp_path, dead_port):
    from kvpool.security import auth

    result = _fails("etcd-auth", "--etcd", f"127.0.0.1:{dead_port}", "--token-file",
                    _secret_file(tmp_path, auth.new_secret()))
    _says(result, "etcd-auth", f"no etcd answers at 127.0.0.1:{dead_port}", "--etcd HOST:PORT")


def test_etcd_auth_on_an_etcd_whose_authentication_is_on_says_so(cluster, tmp_path):
    result = subprocess.run([*KVPOOL, "etcd-auth", "--etcd", cluster.etcd_endpoint, "--token-file",
                             _secret_file(tmp_path, cluster.secret)], capture_output=True, text=True, timeout=60,
                            env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "already on" in result.stdout


def test_etcd_auth_with_a_missing_tls_dir_names_it(tmp_path, dead_port):
    from kvpool.security import auth

    result = _fails("etcd-auth", "--etcd", f"127.0.0.1:{dead_port}", "--token-file",
                    _secret_file(tmp_path, auth.new_secret()), "--tls-dir", str(tmp_path / "no-tls"))
    _says(result, "etcd-auth", str(tmp_path / "no-tls"), "ca.pem")


def test_tls_into_a_path_that_cannot_be_made_names_the_path(tmp_path):
    (tmp_path / "file").write_text("")
    result = _fails("tls", str(tmp_path / "file" / "tls"))
    _says(result, "tls", str(tmp_path / "file" / "tls"), "Not a directory")


def test_up_with_a_data_dir_that_cannot_be_made_names_the_path(tmp_path):
    (tmp_path / "file").write_text("")
    result = _fails("up", "--nodes", "1", "--data-dir", str(tmp_path / "file" / "data"))
    _says(result, "up", str(tmp_path / "file" / "data"), "Not a directory")


def test_config_with_a_broken_file_keeps_its_message(tmp_path):
    (tmp_path / "bad.toml").write_text("[master\n")
    _says(_fails("config", "--config", str(tmp_path / "bad.toml")), "config", "not valid TOML")


@pytest.mark.parametrize("switch", ["--debug", "KVPOOL_DEBUG=1"])
def test_the_traceback_comes_only_on_request(dead_port, switch):
    args, env = (["--debug"], _env()) if switch == "--debug" else ([], _env(KVPOOL_DEBUG="1"))
    result = subprocess.run([*KVPOOL, "status", "--master", f"127.0.0.1:{dead_port}", *args],
                            capture_output=True, text=True, timeout=90, env=env)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "UnavailableError" in result.stderr, result.stderr[-3000:]
    assert _last_line(result).startswith(f"kvpool status: no master answers at 127.0.0.1:{dead_port}")


def _interruptible() -> None:
    """In the child before it runs: Ctrl-C reaches it as at a terminal, however this run was started (a suite
    started in the background inherits SIGINT ignored, and so would the command)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_quietly_with_130():
    # A "master" that takes the call and never answers it: status waits on it until interrupted. (A socket that
    # accepts and stays silent is no such master: the client gives up on it at once, before any Ctrl-C.)
    import threading
    from concurrent import futures

    import grpc

    inside, release = threading.Event(), threading.Event()

    def never_answers(request, context):
        inside.set()
        release.wait(60)
        context.abort(grpc.StatusCode.UNAVAILABLE, "test over")

    class Handler(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(never_answers)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=(Handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proc = subprocess.Popen([*KVPOOL, "status", "--master", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=_interruptible)
    try:
        assert inside.wait(60), "the command never made its call"
        proc.send_signal(signal.SIGINT)  # the command is now inside its call
        _, stderr = proc.communicate(timeout=30)
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop(None)
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr == "", stderr[-3000:]


def test_ctrl_c_that_a_library_swallows_still_ends_the_command_as_interrupted():
    """grpc.aio's callbacks can catch the KeyboardInterrupt of a Ctrl-C: the call then ends with some other
    error (or none). The command still exits 130, quietly, not with that error's line."""
    program = ("import sys, time\n"
               "from kvpool.commands import cli\n"
               "from kvpool.errors import UnavailableError\n"
               "def swallowing(argv, given):\n"
               "    print('inside', flush=True)\n"
               "    try:\n"
               "        time.sleep(30)\n"
               "    except KeyboardInterrupt:\n"
               "        raise UnavailableError('master 127.0.0.1:1 Stats: cancelled') from None\n"
               "cli._run = swallowing\n"
               "sys.exit(cli.main(['status']))\n")
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), preexec_fn=_interruptible)
    try:
        assert proc.stdout.readline() == "inside\n"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, stderr) == (130, "")


def test_a_tls_cluster_reached_without_its_ca_or_with_a_missing_one_says_what_to_give(own_cluster, tmp_path):
    running = own_cluster(nodes=1, tls=True, dram_per_node="32MiB")
    token = _env(KVPOOL_TOKEN_FILE=str(running.client_token_file))
    for args in (["--master", running.master_address], ["--etcd", running.etcd_endpoint]):
        _says(_fails("status", *args, env=token), "status", "closed the connection", "KVPOOL_TLS_CA")
    missing = str(tmp_path / "no-ca.pem")
    _says(_fails("status", "--master", running.master_address, env={**token, "KVPOOL_TLS_CA": missing}), "status",
          f"{missing} ($KVPOOL_TLS_CA): No such file")
    secret = _secret_file(tmp_path, running.secret)
    _says(_fails("etcd-auth", "--etcd", running.etcd_endpoint, "--token-file", secret), "etcd-auth",
          "closed the connection", "--tls-dir")


def test_up_whose_node_cannot_start_names_the_node_and_its_reason(tmp_path):
    result = _fails("up", "--nodes", "1", "--dram-per-node", "32MiB", "--transports", "bogus",
                    "--data-dir", str(tmp_path), timeout=120)
    _says(result, "up", "node-0 exited", "unknown transport(s) bogus")
    assert "usage:" not in _last_line(result)  # the node's log tail is cut to its last line


def test_router_with_the_client_token_passes_its_check_and_serves(cluster):
    proc = subprocess.Popen([*KVPOOL, "router", "--engine", "a=", "--namespace", NAMESPACE, "--master",
                             cluster.master_address, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(KVPOOL_TOKEN_FILE=str(cluster.client_token_file)))
    try:
        line = proc.stdout.readline()  # the router prints it once it serves, or exits (then: "")
        assert line.startswith("kvpool router ready http://127.0.0.1:"), line + proc.stderr.read()
        proc.terminate()  # not SIGINT: the router prints its line just before it takes over SIGINT
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
