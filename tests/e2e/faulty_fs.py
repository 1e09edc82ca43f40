"""A FUSE file system of the tests' own (libfuse 3 from Debian's fuse3, mfusepy from PyPI) that mirrors a backing
directory and fails on command, for the disk-fault tests (tests/e2e/test_disk_faults.py).

Run as a process: `python faulty_fs.py BACKING MOUNTPOINT`; it prints "mounted" once the mount answers, then reads
commands on stdin, one per line, each answered "ok" on stdout:
  ok          every call is passed through
  eio         every call fails with EIO
  enospc      writes, creates and fsyncs fail with ENOSPC; reads and the rest pass
  slow S      every call waits S seconds first
  hang        every call waits until the next command (an NFS mount whose server stopped answering)
The FaultyFs class below starts, commands and unmounts it."""

import errno
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
_WRITES = {"write", "create", "fsync", "truncate", "mkdir", "rename", "fallocate", "mknod"}


def serve(backing: str, mountpoint: str) -> None:
    import mfusepy as fuse

    state = {"mode": "ok", "delay": 0.0}
    changed = threading.Condition()

    def gate(op: str) -> None:
        with changed:
            while state["mode"] == "hang":
                changed.wait()
            mode, delay = state["mode"], state["delay"]
        if mode == "slow":
            time.sleep(delay)
        elif mode == "eio":
            raise fuse.FuseOSError(errno.EIO)
        elif mode == "enospc" and op in _WRITES:
            raise fuse.FuseOSError(errno.ENOSPC)

    def passed(op: str):
        def call(self, path, *args):
            gate(op)
            try:
                return getattr(self, f"_{op}")(os.path.join(backing, path.lstrip("/")), *args)
            except OSError as exc:
                raise fuse.FuseOSError(exc.errno or errno.EIO) from None
        return call

    class Mirror(fuse.Operations):
        use_ns = True

        @staticmethod
        def _getattr(path, fh=None):
            st = os.lstat(path)
            return {name: getattr(st, name) for name in (
                "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")} | {
                "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}

        @staticmethod
        def _readdir(path, fh):
            return [".", "..", *os.listdir(path)]

        @staticmethod
        def _open(path, flags):
            return os.open(path, flags)

        @staticmethod
        def _create(path, mode, fi=None):
            return os.open(path, os.O_RDWR | os.O_CREAT, mode)  # the kernel checks the caller's access mode

        @staticmethod
        def _read(path, size, offset, fh):
            return os.pread(fh, size, offset)

        @staticmethod
        def _write(path, data, offset, fh):
            return os.pwrite(fh, data, offset)

        @staticmethod
        def _truncate(path, length, fh=None):
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(path, length)

        @staticmethod
        def _fsync(path, datasync, fh):
            os.fsync(fh)

        @staticmethod
        def _flush(path, fh):
            return 0

        @staticmethod
        def _release(path, fh):
            os.close(fh)

        @staticmethod
        def _unlink(path):
            os.unlink(path)

        @staticmethod
        def _mkdir(path, mode):
            os.mkdir(path, mode)

        @staticmethod
        def _rmdir(path):
            os.rmdir(path)

        @staticmethod
        def _rename(path, new, flags=0):
            os.rename(path, os.path.join(backing, new.lstrip("/")))

        @staticmethod
        def _chmod(path, mode):
            os.chmod(path, mode)

        @staticmethod
        def _utimens(path, times=None):
            os.utime(path, ns=times) if times else os.utime(path)

        @staticmethod
        def _statfs(path):
            st = os.statvfs(path)
            return {name: getattr(st, name) for name in (
                "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
                "f_flag", "f_namemax")}

        @staticmethod
        def _fallocate(path, mode, offset, length, fh):
            if mode:
                raise OSError(errno.EOPNOTSUPP, "only plain allocation")
            os.posix_fallocate(fh, offset, length)

        def release(self, path, fh):  # never refused: a descriptor the kernel lets go must be closed
            os.close(fh)
            return 0

        def flush(self, path, fh):
            gate("flush")
            return 0

    for op in ("getattr", "readdir", "open", "create", "read", "write", "truncate", "fsync", "unlink", "mkdir",
               "rmdir", "rename", "chmod", "utimens", "statfs", "fallocate"):
        setattr(Mirror, op, passed(op))

    def commands() -> None:
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            with changed:
                state["mode"] = words[0]
                state["delay"] = float(words[1]) if len(words) > 1 else 0.0
                changed.notify_all()
            print("ok", flush=True)
        with changed:  # stdin closed: the tests are done with it; let every call through
            state["mode"] = "ok"
            changed.notify_all()

    def announce() -> None:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mountpoint) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("mounted", flush=True)
        commands()

    threading.Thread(target=announce, daemon=True).start()
    fuse.FUSE(Mirror(), mountpoint, foreground=True, nothreads=False, allow_other=True, default_permissions=True)


class FaultyFs:
    """The file system above, mounted at `mountpoint` over `backing` for as long as the object is open."""

    def __init__(self, backing: Path, mountpoint: Path):
        self.backing, self.mountpoint = Path(backing), Path(mountpoint)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "FaultyFs":
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, str(HERE), str(self.backing), str(self.mountpoint)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._expect("mounted", 30)
        return self

    def set(self, mode: str, delay: float | None = None) -> None:
        self.proc.stdin.write(f"{mode} {delay}\n" if delay is not None else f"{mode}\n")
        self.proc.stdin.flush()
        self._expect("ok", 10)

    def _expect(self, word: str, timeout: float) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise TimeoutError(f"the faulty file system did not say {word!r} within {timeout}s")
            line = self.proc.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"the faulty file system said {line!r}, not {word!r} (exit {self.proc.poll()})")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # every call through again, so nothing holds the mount
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, timeout=30)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def unavailable() -> str | None:
    """Why a FUSE file system cannot be mounted here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if os.geteuid() != 0:
        return "mounting needs root"
    try:
        import mfusepy  # noqa: F401 - loads libfuse
    except (ImportError, OSError, EnvironmentError) as exc:
        return f"libfuse 3 or mfusepy is missing ({exc}): apt-get install fuse3; pip install mfusepy"
    from shutil import which
    return None if which("fusermount3") else "fusermount3 is missing: apt-get install fuse3"


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
