"""The parts of benchmarks/gpu_check.py that are not measurements: the one JSON line and the budget that bounds
the run, the watch on host waits during kvpool calls, and the memory a transfer goes from and into."""

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import Counter


# -- the one JSON line, printed once (by the run, or by the watchdog past the budget)

class Report:
    def __init__(self, out_path: str | None):
        self.data: dict = {"benchmark": "gpu_check", "error": None, "errors": []}
        self.out_path = out_path
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._emitted = False
        self.section = "start"

    def fail(self, section: str, exc: BaseException) -> None:
        """A section that failed: noted, and the run goes on with the next one."""
        text = f"{section}: {type(exc).__name__}: {exc}"
        self.data["errors"].append(text)
        if self.data["error"] is None:
            self.data["error"] = text
        print(f"gpu_check: {text}\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    def emit(self) -> bool:
        """Print the line (and write --out); False if it was printed already."""
        with self._lock:
            if self._emitted:
                return False
            self._emitted = True
        self.data["wall_s"] = round(time.monotonic() - self.started, 2)
        line = None
        for _ in range(5):  # the run's thread may still be adding to it (watchdog)
            try:
                line = json.dumps(self.data, default=str)
                break
            except RuntimeError:
                time.sleep(0.05)
        if line is None:
            line = json.dumps({"benchmark": "gpu_check", "error": self.data.get("error"),
                               "wall_s": self.data["wall_s"]})
        print(line, flush=True)
        if self.out_path:
            try:
                with open(self.out_path, "w") as out:
                    out.write(line + "\n")
            except OSError as exc:
                print(f"gpu_check: cannot write {self.out_path}: {exc}", file=sys.stderr, flush=True)
        return True


class Watchdog:
    """Past `budget` seconds: the line goes out with an error, the cluster's processes are killed, exit 1."""

    def __init__(self, report: Report, budget: float):
        self.report, self.budget = report, budget
        self.cluster = None
        self.work_dir: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-check-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def _run(self) -> None:
        if self._done.wait(self.budget):
            return
        report = self.report
        report.data["error"] = f"timed out after {self.budget:.0f} s (during {report.section})"
        report.emit()
        kill_cluster(self.cluster)
        if self.work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        os._exit(1)


def kill_cluster(cluster) -> None:
    if cluster is None:
        return
    for child in [*getattr(cluster, "nodes", []), *getattr(cluster, "masters", [])]:
        try:
            child.kill()
        except Exception:
            pass
    try:
        from kvpool.storenode.storage.dram import remove_stale_segments
        for node in getattr(cluster, "nodes", []):
            remove_stale_segments(cluster.cluster, node.name)
    except Exception:
        pass
    for server in getattr(cluster, "etcd_servers", []):
        try:
            if server.proc is not None:
                server.proc.kill()
                server.proc.wait(5)
        except Exception:
            pass
    # One still starting is not in the lists yet: every child of this process goes (each leads its own session).
    for pid in own_children():
        try:
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def own_children() -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            children.append(int(entry))
    return children


# -- host waits during kvpool calls

class SyncWatch:
    """Counts, while active (inside a kvpool call), the host waits the device pipeline must never make.

    Event.record is wrapped to remember the stream each event was recorded on, so that a wait on an event of
    the client's copy stream (CudaCopyEngine._stream: how the pipeline waits for its own copies) is told apart
    from one on any other stream."""

    def __init__(self, torch, copy_streams):
        self.torch = torch
        self.copy_streams = copy_streams  # () -> the copy streams of the clients (those made so far)
        self.active = 0
        self.bad: Counter = Counter()
        self.allowed: Counter = Counter()  # waits on copy-stream events (informational)
        cuda = torch.cuda
        self._saved = [(cuda, "synchronize", cuda.synchronize), (cuda.Stream, "synchronize", cuda.Stream.synchronize),
                       (cuda.Event, "record", cuda.Event.record), (cuda.Event, "synchronize", cuda.Event.synchronize),
                       (cuda.Event, "query", cuda.Event.query)]
        self._streams_of: dict[int, int] = {}  # id(event) -> cuda_stream handle, for events without a __dict__
        watch = self
        real_sync, real_stream_sync = cuda.synchronize, cuda.Stream.synchronize
        real_record, real_event_sync, real_query = cuda.Event.record, cuda.Event.synchronize, cuda.Event.query

        def synchronize(*args, **kwargs):
            if watch.active:
                watch.bad["torch.cuda.synchronize"] += 1
            return real_sync(*args, **kwargs)

        def stream_synchronize(self, *args, **kwargs):
            if watch.active:
                watch.bad["Stream.synchronize" + (" (copy stream)" if watch._is_copy(self.cuda_stream) else "")] += 1
            return real_stream_sync(self, *args, **kwargs)

        def record(self, stream=None):
            handle = (stream if stream is not None else torch.cuda.current_stream()).cuda_stream
            try:
                self._gpu_check_stream = handle
            except AttributeError:
                watch._streams_of[id(self)] = handle
            return real_record(self, stream)

        def waiter(name, real):
            def wait(self, *args, **kwargs):
                if watch.active:
                    handle = getattr(self, "_gpu_check_stream", watch._streams_of.get(id(self)))
                    if handle is not None and watch._is_copy(handle):
                        watch.allowed[f"Event.{name} (copy stream)"] += 1
                    elif handle is None:
                        watch.bad[f"Event.{name} (never recorded here)"] += 1
                    else:
                        watch.bad[f"Event.{name} (other stream)"] += 1
                return real(self, *args, **kwargs)
            return wait

        cuda.synchronize = synchronize
        cuda.Stream.synchronize = stream_synchronize
        cuda.Event.record = record
        cuda.Event.synchronize = waiter("synchronize", real_event_sync)
        cuda.Event.query = waiter("query", real_query)

    def _is_copy(self, handle: int) -> bool:
        return any(stream is not None and stream.cuda_stream == handle for stream in self.copy_streams())

    def restore(self) -> None:
        for owner, name, value in self._saved:
            setattr(owner, name, value)

    def __enter__(self):
        self.active += 1

    def __exit__(self, *exc):
        self.active -= 1

    def report(self) -> dict:
        return {"total": sum(self.bad.values()), "by_call": dict(self.bad),
                "copy_stream_event_waits": dict(self.allowed)}


class EngineWatch:
    """--engine cpu: the host-memory engine has no stream a host could synchronize; nothing to count."""

    def __init__(self, engines):
        self.engines = engines

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def restore(self) -> None:
        pass

    def report(self) -> None:
        return None


# -- memory: what a transfer goes from and into, and how it is checked

class TorchMemory:
    """Tensors on `device` ("cuda" or "cpu") of random bytes; checked on that device."""

    def __init__(self, torch, device: str):
        self.torch, self.device = torch, device

    def make(self, nbytes: int, seed: int):
        torch = self.torch
        generator = torch.Generator(device=self.device).manual_seed(seed)
        source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=self.device, generator=generator)
        return source, torch.empty_like(source)

    def scramble(self, source, dest) -> None:
        """Every byte of dest unlike source's: a byte a get leaves unwritten shows as wrong."""
        self.torch.bitwise_not(source, out=dest)

    def wrong(self, source, dest) -> int:
        if self.torch.equal(source, dest):
            return 0
        return int((source != dest).sum().item())

    def settle(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


class NumpyMemory:
    """Host buffers where torch is not installed (--engine cpu only)."""

    def __init__(self):
        import numpy
        self.numpy = numpy

    def make(self, nbytes: int, seed: int):
        source = self.numpy.random.default_rng(seed).integers(0, 256, nbytes, dtype=self.numpy.uint8)
        return source, self.numpy.empty_like(source)

    def scramble(self, source, dest) -> None:
        self.numpy.invert(source, out=dest)

    def wrong(self, source, dest) -> int:
        return int(self.numpy.count_nonzero(source != dest))

    def settle(self) -> None:
        pass


class CpuEngineMemory:
    """CpuCopyEngine's DeviceBuffers (no buffer protocol: only the engine's copies reach them)."""

    def __init__(self, engine):
        import numpy
        self.numpy, self.engine = numpy, engine

    def make(self, nbytes: int, seed: int):
        data = self.numpy.random.default_rng(seed).integers(0, 256, nbytes, dtype=self.numpy.uint8)
        source = self.engine.buffer(data.tobytes())
        source.expected = data
        return source, self.engine.buffer(nbytes)

    def scramble(self, source, dest) -> None:
        self.engine.settle()
        dest.fill(self.numpy.invert(source.expected))

    def wrong(self, source, dest) -> int:
        got = self.numpy.frombuffer(dest.read(), self.numpy.uint8)
        return int(self.numpy.count_nonzero(got != source.expected))

    def settle(self) -> None:
        self.engine.settle()
