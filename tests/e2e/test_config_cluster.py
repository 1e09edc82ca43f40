"""A cluster started from the example config file alone (`kvpool up --config deploy/kvpool.toml`)."""

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from kvpool import Client

ROOT = Path(__file__).resolve().parents[2]


def test_kvpool_up_from_the_example_config_file(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}  # the file alone
    example = ROOT / "deploy" / "kvpool.toml"
    up = subprocess.Popen([sys.executable, "-m", "kvpool.commands.cli", "up", "--config", str(example)], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = up.stdout.readline()
        assert ready.startswith("kvpool ready"), ready + up.stderr.read()[-3000:]
        master = dict(word.split("=", 1) for word in ready.split()[2:])["master"]
        clients = up.stdout.readline()
        token_file = clients.split("KVPOOL_TOKEN_FILE=", 1)[1].split()[0]
        metrics = [up.stdout.readline().split() for _ in range(3)]  # [up] metrics = true: master and 2 nodes
        assert [line[0] for line in metrics] == ["metrics"] * 3
        status = subprocess.run([sys.executable, "-m", "kvpool.commands.cli", "status", "--json", "--master", master,
                                 "--token-file", token_file], capture_output=True, text=True, timeout=60, check=True)
        nodes = json.loads(status.stdout)["nodes"]
        assert len(nodes) == 2  # [up] nodes = 2
        for node in nodes:  # [up] dram-per-node = "256MiB"
            dram = next(t for t in node["tiers"] if t["tier"] == "DRAM")
            assert int(dram["capacity"]) == 256 << 20
        with urllib.request.urlopen(metrics[1][2], timeout=10) as answer:
            assert answer.status == 200 and b"kvpool_" in answer.read()
        with Client(master, token=Path(token_file).read_text().strip()) as client:
            client.put("from-the-config", b"x" * 1000)
            assert client.get("from-the-config") == b"x" * 1000
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
