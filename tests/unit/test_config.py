"""The config file: precedence (flag > environment > command table > [cluster] > default), refusals that name
the key, and the reference kept equal to what the commands take."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.runtime import config
from kvpool.commands.cli import command_parsers

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "kvpool.toml"
    path.write_text(text)
    return path


def resolve(command: str, argv: list[str]):
    return config.resolve(command_parsers()[command], command, argv)


def test_flag_over_environment_over_table_over_cluster_over_default(tmp_path, monkeypatch):
    path = write(tmp_path, '[cluster]\netcd = "e:1"\ncluster = "c1"\n'
                           '[storenode]\ndram = "64MiB"\ncluster = "c2"\nlow-watermark = 0.5\nlease_ttl = 3\n')
    monkeypatch.setenv("KVPOOL_STORENODE_LOW_WATERMARK", "0.6")
    args, sources = resolve("storenode", ["--config", str(path), "--lease-ttl", "7"])
    assert args.etcd == "e:1" and sources["etcd"] == f"{path} [cluster]"
    assert args.cluster == "c2" and sources["cluster"] == f"{path} [storenode]"
    assert args.dram == 64 << 20  # the option's own conversion: a size
    assert args.low_watermark == 0.6 and sources["low_watermark"] == "$KVPOOL_STORENODE_LOW_WATERMARK"
    assert args.lease_ttl == 7 and sources["lease_ttl"] == "flag"
    assert args.high_watermark == 0.95 and sources["high_watermark"] == "default"
    # KVPOOL_CLUSTER_<OPTION> reaches every command with the (shared) option, under its own table's variable.
    monkeypatch.setenv("KVPOOL_CLUSTER_ETCD", "e:2")
    args, sources = resolve("master", [])
    assert args.etcd == "e:2" and sources["etcd"] == "$KVPOOL_CLUSTER_ETCD"
    monkeypatch.setenv("KVPOOL_MASTER_ETCD", "e:3")
    assert resolve("master", [])[0].etcd == "e:3"
    monkeypatch.delenv("KVPOOL_CLUSTER_ETCD")
    monkeypatch.delenv("KVPOOL_MASTER_ETCD")
    # KVPOOL_CONFIG names the file when --config does not; required options may come from it.
    monkeypatch.setenv(config.CONFIG_ENV, str(path))
    args, _ = resolve("storenode", [])
    assert args.dram == 64 << 20 and args.etcd == "e:1"


@pytest.mark.parametrize("text, named", [
    ("[storenode]\ndram = \"64MiB\"\netcd = \"e:1\"\nhigh-watermrk = 0.9\n", "[storenode] high-watermrk"),
    ("[storenode]\ndram = \"64 parsecs\"\netcd = \"e:1\"\n", "[storenode] dram"),
    ("[master]\netcd = \"e:1\"\nput-timeout = \"soon\"\n", "[master] put-timeout"),
    ("[cluster]\ndram = \"1GiB\"\n", "[cluster] dram"),
    ("[storenode]\ndram = \"64MiB\"\netcd = \"e:1\"\npolicy = \"random\"\n", "[storenode] policy"),
    ("[nodes]\ncount = 2\n", "[nodes]"),
    ("[storenode\n", "not valid TOML"),
])
def test_bad_settings_are_refused_at_start_naming_the_key(tmp_path, text, named):
    command = "master" if "[master]" in text else "storenode"
    path = write(tmp_path, text)
    run = subprocess.run([sys.executable, "-m", f"kvpool.{command}", "--config", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and named in run.stderr, run.stderr


def test_watermarks_out_of_order_are_refused(tmp_path):
    path = write(tmp_path, '[storenode]\netcd = "e:1"\ndram = "64MiB"\nhigh-watermark = 0.5\nlow-watermark = 0.8\n')
    run = subprocess.run([sys.executable, "-m", "kvpool.storenode", "--config", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "--low-watermark must be below --high-watermark" in run.stderr


def test_booleans_lists_and_environment_words(tmp_path, monkeypatch):
    path = write(tmp_path, '[up]\nmetrics = true\ntls = false\n')
    args, _ = resolve("up", ["--config", str(path)])
    assert args.metrics is True and args.tls is False
    monkeypatch.setenv("KVPOOL_UP_METRICS", "no")
    args, sources = resolve("up", ["--config", str(path)])
    assert args.metrics is False and sources["metrics"] == "$KVPOOL_UP_METRICS"
    path = write(tmp_path, '[router]\nengine = ["a=tcp://h:1", "b=tcp://h:2"]\n'
                           'namespace = "kv/m/f/l/bs16/heads-1/rank0of1/"\n')
    args, _ = resolve("router", ["--config", str(path)])
    assert args.engine == ["a=tcp://h:1", "b=tcp://h:2"]


def test_every_shared_key_is_some_commands_setting():
    taken = set().union(*(config.options(p) for p in command_parsers().values()))
    assert config.SHARED_KEYS <= taken


def test_the_reference_is_what_the_commands_take():
    made = subprocess.run([sys.executable, "-m", "kvpool.commands.cli", "config", "--reference"], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    assert made == (ROOT / "docs" / "config-reference.md").read_text(), \
        "docs/config-reference.md is stale: kvpool config --reference > docs/config-reference.md"


def test_config_command_shows_each_settings_source(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOOL_MASTER_MAX_REPLICAS", "3")
    example = ROOT / "deploy" / "kvpool.toml"
    out = subprocess.run([sys.executable, "-m", "kvpool.commands.cli", "config", "--config", str(example), "master"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "max-replicas = 3  # $KVPOOL_MASTER_MAX_REPLICAS" in out.splitlines()
    assert f"put-timeout = 30.0  # {example} [master]" in out.splitlines()
    assert "# etcd = ?  # required: not set" in out.splitlines()
