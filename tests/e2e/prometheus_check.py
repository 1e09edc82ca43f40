"""A real Prometheus server (the `prometheus` binary: Debian's package) scraping a running cluster, and the check
that every query of every panel of a Grafana dashboard returns data through its HTTP API.

Tests and benchmarks share it: `Prometheus(targets, work_dir)` runs the server on a free loopback port with its
own storage in `work_dir`; `check_dashboard(dashboard, url, variables)` evaluates each panel query (rows and
nested panels included, so a panel added to the JSON is covered with no change here) and returns every failure.
A benchmark outside tests/ puts this folder on sys.path first, as benchmarks/cross_host.py does for its helpers.
"""

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

from kvpool.launch.local_cluster import stop_process
from kvpool.net.netutil import free_port, wait_until

PROMETHEUS = shutil.which("prometheus")
MISSING = "the prometheus binary is not installed (apt-get install prometheus)"

# Grafana's built-in variables, as Grafana would fill them for a 5-minute view of targets scraped every second.
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__interval_ms": "15000", "__range": "5m",
                     "__range_s": "300", "__range_ms": "300000"}
# $name, ${name}, ${name:format} and [[name]], as Grafana writes a variable in a query.
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)\]\]")


class Prometheus:
    """The prometheus binary scraping `targets` (name -> metrics URL) every `interval` seconds, each target
    labelled instance=<its name> and component= as deploy/prometheus/prometheus.yml labels it; a context
    manager that stops the server and keeps its log in work_dir."""

    def __init__(self, targets: dict, work_dir: Path, interval: float = 1.0, timeout: float = 30.0):
        if PROMETHEUS is None:
            raise FileNotFoundError(MISSING)
        self.targets = dict(targets)
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.interval = interval
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = self.work_dir / "prometheus.yml"
        config.write_text(json.dumps(self._config()))  # JSON is YAML
        self.log_path = self.work_dir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={self.work_dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(self._ready, timeout, interval=0.1, what=f"prometheus to be ready ({self.log_path})")
        except BaseException:
            self.stop()
            raise

    def _config(self) -> dict:
        every = f"{round(self.interval * 1000)}ms"  # Prometheus takes no fractions in a duration
        jobs = []
        for name, url in self.targets.items():
            parts = urllib.parse.urlsplit(url)
            jobs.append({"job_name": f"kvpool-{name}", "metrics_path": parts.path or "/metrics",
                         "scheme": parts.scheme, "scrape_interval": every, "scrape_timeout": every,
                         "static_configs": [{"targets": [parts.netloc],
                                             "labels": {"instance": name, "component": _component(name)}}]})
        return {"global": {"scrape_interval": every}, "scrape_configs": jobs}

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            last = self.log_path.read_text(errors="replace").splitlines()[-3:]
            raise RuntimeError(f"prometheus exited with {self.process.returncode}: " + "\n".join(last))
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict:
        """The `data` of a Prometheus HTTP API answer; RuntimeError with Prometheus's own message on an error."""
        url = f"{self.url}/api/v1/{path}"
        body = urllib.parse.urlencode(params).encode() if params else None
        return api_call(url, body)

    def values(self, expr: str) -> list[float]:
        """The values of the instant query `expr` now, one per series."""
        return [float(v) for v in _values(self.api("query", query=expr))]

    def wait_scraped(self, timeout: float = 30.0, scrapes: int = 2) -> None:
        """Wait until every target is up and has been scraped `scrapes` times from now on, so what happened
        before this call is in the database with enough samples for rate()."""
        since = time.time()
        for _ in range(scrapes):
            def scraped_after(moment=since) -> float | None:
                active = self.api("targets")["activeTargets"]
                if len(active) < len(self.targets) or any(t["health"] != "up" for t in active):
                    return None
                last = [_seconds(t["lastScrape"]) for t in active]
                return max(last) if min(last) > moment else None

            since = wait_until(scraped_after, timeout, interval=0.1,
                               what=f"prometheus to scrape every target of {sorted(self.targets)}")

    def stop(self) -> None:
        if self.process.poll() is None:
            stop_process(self.process)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _component(name: str) -> str:
    """LocalCluster's "node-0" is a "storenode", as in deploy/prometheus/prometheus.yml; "master" is itself."""
    kind = name.split("-")[0]
    return "storenode" if kind == "node" else kind


def api_call(url: str, body: bytes | None = None) -> dict:
    try:
        with urllib.request.urlopen(url, data=body, timeout=10) as answer:
            reply = json.load(answer)
    except urllib.error.HTTPError as error:  # a bad query answers 400 with the reason in its JSON body
        reply = json.load(error)
    if reply.get("status") != "success":
        raise RuntimeError(f"{reply.get('errorType')}: {reply.get('error')}")
    return reply["data"]


def _seconds(rfc3339: str) -> float:
    """Seconds since the epoch of Prometheus's lastScrape (nanoseconds and a zone: 2026-01-01T00:00:00.123456789Z)."""
    stamp = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", rfc3339)
    if stamp is None or stamp.group(1).startswith("0001"):  # never scraped
        return 0.0
    whole = datetime.fromisoformat(stamp.group(1) + stamp.group(3).replace("Z", "+00:00"))
    return whole.timestamp() + float(stamp.group(2) or 0)


def panels(dashboard: dict):
    """Every panel of a dashboard, those inside rows (expanded or collapsed) included."""
    def walk(items):
        for panel in items:
            yield panel
            yield from walk(panel.get("panels", ()))
    yield from walk(dashboard.get("panels", ()))


def dashboard_queries(dashboard_path) -> list[tuple[str, str, str]]:
    """(panel title, target refId, PromQL expression) of every query target of the dashboard."""
    dashboard = json.loads(Path(dashboard_path).read_text())
    return [(panel.get("title", f"panel {panel.get('id')}"), target.get("refId", "?"), target["expr"])
            for panel in panels(dashboard) for target in panel.get("targets", ()) if "expr" in target]


def fill_variables(expr: str, variables: dict) -> str:
    """`expr` with Grafana's variables replaced by `variables` (over GRAFANA_VARIABLES); KeyError naming a
    variable that has no value."""
    values = {**GRAFANA_VARIABLES, **variables}

    def value(match: re.Match) -> str:
        name = next(group for group in match.groups() if group)
        if name not in values:
            raise KeyError(f"no value for the template variable ${name}")
        return str(values[name])

    return _VARIABLE.sub(value, expr)


_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),)?\s*(\w+)\s*\)\s*$")


def template_values(dashboard_path, prometheus_url: str) -> dict:
    """A value for each of the dashboard's own template variables, as Grafana would pick one: a
    label_values(metric, label) query's first value in Prometheus, a custom or constant variable's first
    option, else its current value; a variable with no value is left out (its queries then fail)."""
    values = {}
    for variable in json.loads(Path(dashboard_path).read_text()).get("templating", {}).get("list", ()):
        name, kind = variable.get("name"), variable.get("type")
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        found = _LABEL_VALUES.match(query) if kind == "query" else None
        if found:
            match = urllib.parse.urlencode({"match[]": found.group(1)}) if found.group(1) else ""
            options = api_call(f"{prometheus_url}/api/v1/label/{found.group(2)}/values?{match}")
        elif kind in ("custom", "constant"):
            options = [option.strip() for option in query.split(",") if option.strip()]
        else:
            options = [variable.get("current", {}).get("value")]
        options = [option for option in options if option not in (None, "", "$__all")]
        if options:
            values[name] = options[0]
    return values


def check_dashboard(dashboard_path, prometheus_url: str, variables: dict | None = None) -> list[str]:
    """Evaluate every panel query of the dashboard at `prometheus_url` (/api/v1/query, now), its template
    variables filled from `variables`, else as template_values() picks them; returns one line per query that
    fails (no variable value, an error, an empty result, or no finite value: what Grafana would draw as
    nothing), empty when every query shows data."""
    failures = []
    queries = dashboard_queries(dashboard_path)
    if not queries:
        return [f"{dashboard_path}: no panel queries"]
    filled = {**template_values(dashboard_path, prometheus_url), **(variables or {})}
    for title, ref, expr in queries:
        where = f"panel {title!r} query {ref}: {expr}"
        try:
            query = fill_variables(expr, filled)
            data = api_call(f"{prometheus_url}/api/v1/query", urllib.parse.urlencode({"query": query}).encode())
        except (KeyError, RuntimeError) as error:
            failures.append(f"{where}: {error}")
            continue
        values = _values(data)
        if not values:
            failures.append(f"{where}: no data")
        elif not any(v not in ("NaN", "+Inf", "-Inf") for v in values):
            failures.append(f"{where}: only {sorted(set(values))}")
    return failures


def _values(data: dict) -> list[str]:
    """The sample values of an instant query's result, as Prometheus writes them ("NaN" among them)."""
    if data["resultType"] in ("scalar", "string"):
        return [data["result"][1]]
    return [series["value"][1] for series in data["result"]]
