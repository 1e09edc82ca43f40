"""The shared tier's files: writing, reading, removing objects under `<root>/<cluster>/`, and the scan that tells
a new node what the tier holds. Blocking calls; callers run them in threads. Formats: layout.py.

Crash safety. An object file is written under a temporary dot-name in its own directory, fsynced, renamed
into place and its directory fsynced, so a torn file is never seen under an object's name; a file damaged
later fails its header check or its payload checksum on every read. ADDED is appended (and fsynced) only
after the file is in place, REMOVED before the file is unlinked, so a crash leaves at worst a file no record
names (space, never a wrong answer), never a live record without its file, unless the file system itself
loses a file, which a read then finds missing (KeyNotFoundError) and the reader falls back to another copy.
A manifest torn by a crash mid-append ends at its last whole record for every reader, and its writer cuts it
there before appending again, so no later record hides behind the torn one.
"""

import errno
import io
import os
import secrets
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

from ..errors import (BatchError, ChecksumMismatchError, InvalidArgumentError, InvalidKeyError, KeyNotFoundError,
                      KvpoolError, NoSpaceError, UnavailableError)
from ..protocol.checksum import checksum as checksum_of  # `checksum` is read_into's argument
from ..protocol.keys import MAX_KEY_BYTES
from .layout import (ADDED, HEADER_SIZE, MANIFEST_SUFFIX, MANIFESTS_DIR, OBJECTS_DIR, REMOVED, Scan, SharedObject,
                     fold, object_name, pack_header, pack_record, parse_header, parse_records)

DIR_MODE = 0o750  # clients that read objects directly need the group's read access (same group as the nodes)
FILE_MODE = 0o640
_MANIFEST_APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
_HEAD_READ = HEADER_SIZE + MAX_KEY_BYTES  # enough for any header and key in one read


class DeepTier:
    """What every deep tier's store (this directory, a bucket: kvpool/objectstore/tier.py) has beside its batch
    calls: the one-object forms, a reader's view, closing as a context manager."""

    @staticmethod
    def check_names(tier: str, cluster: str, writer: str | None) -> None:
        for what, name in (("cluster", cluster), ("writer", writer)):
            if name is None and what == "writer":
                continue
            if not name or name.startswith(".") or "/" in name or "\x00" in name:
                raise InvalidArgumentError(f"{tier} {what} name {name!r} must be one plain file name")

    @classmethod
    def reader(cls, root, cluster: str):
        """A view that only reads (a client's): it creates nothing and writes no manifest."""
        return cls(root, cluster, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def write(self, obj: SharedObject, payload) -> int:
        """write_many of one object; its error (NoSpaceError, UnavailableError) raised as itself."""
        try:
            return self.write_many([(obj, payload)])[0]
        except BatchError as exc:
            raise exc.results[0] from None

    def spill(self) -> int:
        """Move what this store holds beyond its share on to a store beneath it (kvpool/objectstore/stacked.py);
        the number moved. None beneath: nothing to do."""
        return 0

    def halt_spill(self) -> None:
        """A spill running in another thread ends after its batch."""

    def probe(self) -> None:
        """Raises while the store does not answer or take writes (kvpool/sharedfs/file_gate.py probes with it).
        A bucket's calls carry deadlines of their own and fail typed: nothing to probe."""

    def remove(self, key: bytes, generation: int) -> bool:
        try:
            return self.remove_many([(key, generation)])[0]
        except BatchError as exc:
            raise exc.results[0] from None


class SharedDir(DeepTier):
    """One process's view of `<root>/<cluster>/`. `writer` names this process's manifest
    (manifests/<writer>.log), which no other live process may share (e.g. "node-1-<instance>")."""

    def __init__(self, root: str, cluster: str, writer: str | None):
        self.check_names("shared", cluster, writer)
        self.base = os.path.join(root, cluster)
        self.objects_dir = os.path.join(self.base, OBJECTS_DIR)
        self.manifests_dir = os.path.join(self.base, MANIFESTS_DIR)
        # None: a reader's view (a client's), which creates nothing and writes no manifest.
        self.manifest_path = os.path.join(self.manifests_dir, writer + MANIFEST_SUFFIX) if writer else None
        if writer is not None:
            for directory in (self.base, self.objects_dir, self.manifests_dir):
                _make_dir(directory)
        self._dirs_made: set[str] = set()  # object directories known to exist (none is ever removed)
        self._manifest_lock = threading.Lock()  # one append (write and fsync) at a time, its length tracked
        self._manifest_fd: int | None = None
        self._manifest_size = 0

    def path(self, key: bytes, generation: int) -> str:
        return os.path.join(self.objects_dir, object_name(key, generation))

    def probe(self) -> None:
        """A writer's: a page written, fsynced, read back and removed beside its manifest (a name starting with
        "." no scan reads); a reader's: the manifests' directory listed."""
        if self.manifest_path is None:
            os.listdir(self.manifests_dir)
            return
        path = os.path.join(self.manifests_dir, "." + os.path.basename(self.manifest_path) + ".probe")
        page = os.urandom(4096)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.pwrite(fd, page, 0)
            os.fsync(fd)
            if os.pread(fd, len(page), 0) != page:
                raise OSError(errno.EIO, f"{path} read back other bytes")
        finally:
            os.close(fd)
        os.unlink(path)

    def exists(self, key: bytes, generation: int) -> bool:
        return os.path.exists(self.path(key, generation))

    # -- writing -------------------------------------------------------------------------------------------

    def write_many(self, items: list[tuple[SharedObject, object]]) -> list[int]:
        """Each object's file (bytes: header, key and payload, any buffer of obj.size bytes whose xxh3_64 is
        obj.checksum, as the caller vouches) put in place, then their ADDED records appended with one write
        and one fsync. Returns each file's length. A file that cannot be written leaves nothing behind and
        the others still go in: BatchError then, its `results` each item's length or error (NoSpaceError,
        UnavailableError). A failed directory fsync or manifest append raises for the whole batch, with no
        record written (the files already in place are then unreferenced: space, never a wrong answer)."""
        self._writer()
        prepared = []
        for obj, payload in items:  # every argument checked before any I/O
            _check_key(obj.key)
            view = memoryview(payload).cast("B")
            if view.nbytes != obj.size:
                raise InvalidArgumentError(f"payload of {view.nbytes} bytes for shared object {obj.key!r} "
                                           f"generation {obj.generation} of size {obj.size}")
            try:
                header = pack_header(obj)
            except struct.error as exc:
                raise InvalidArgumentError(f"shared object {obj.key!r}: a field out of range ({exc})") from None
            prepared.append((obj, header, view))
        results = list(_syncing().map(self._place_or_error, prepared))
        placed = [obj for (obj, _, _), result in zip(prepared, results) if not isinstance(result, KvpoolError)]
        directories = {os.path.dirname(self.path(obj.key, obj.generation)) for obj in placed}
        try:
            for _ in _syncing().map(_fsync_dir, sorted(directories)):
                pass
            if placed:
                self._append([pack_record(ADDED, obj) for obj in placed])
        except OSError as exc:
            raise _typed(exc, f"recording {len(placed)} shared objects") from exc
        raise_failures("write", [obj.key for obj, _, _ in prepared], results)
        return results

    def _place_or_error(self, prepared: tuple[SharedObject, bytes, memoryview]) -> int | KvpoolError:
        obj, header, view = prepared
        path = self.path(obj.key, obj.generation)
        try:
            return self._place(path, header, view)
        except OSError as exc:
            return _typed(exc, f"writing {path}")

    def _place(self, path: str, header: bytes, payload: memoryview) -> int:
        directory, name = os.path.split(path)
        self._ensure_dir(directory)
        # A dot-name never matches an object's name (hex digits), and the random part keeps two writers of the
        # same version off each other's temporary file.
        temp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            try:
                os.fchmod(fd, FILE_MODE)  # exactly, whatever the umask
                _write_all(fd, [header, payload])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, path)
        except BaseException:
            _unlink_quietly(temp)
            raise
        return len(header) + payload.nbytes

    def _ensure_dir(self, directory: str) -> None:
        if directory in self._dirs_made:
            return
        _make_dir(os.path.dirname(directory))
        _make_dir(directory)
        self._dirs_made.add(directory)

    # -- the manifest --------------------------------------------------------------------------------------

    def _append(self, records: list[bytes]) -> None:
        """records appended to this writer's manifest with one write and one fsync. On failure the manifest
        is cut back to its last whole record, so that no later record sits behind a torn one."""
        data = b"".join(records)
        with self._manifest_lock:
            fd = self._open_manifest()
            try:
                _write_all(fd, [data])  # O_APPEND: one write unless the file system takes it in pieces
                os.fsync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, self._manifest_size)
                except OSError:  # the next append opens it again and cuts it then, or fails
                    self._close_manifest()
                raise
            self._manifest_size += len(data)

    def _writer(self) -> None:
        if self.manifest_path is None:
            raise InvalidArgumentError("a reader's view of the shared tier writes nothing")

    def _open_manifest(self) -> int:
        if self._manifest_fd is not None:
            return self._manifest_fd
        fd = os.open(self.manifest_path, _MANIFEST_APPEND, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
            # The same writer name used before (a restart) may have left a torn record at the end.
            existing = _read_all(fd)
            whole = parse_records(existing).valid_bytes
            if whole < len(existing):
                os.ftruncate(fd, whole)
                os.fsync(fd)
            _fsync_dir(self.manifests_dir)  # the manifest's own name, if this just made it
        except BaseException:
            os.close(fd)
            raise
        self._manifest_fd, self._manifest_size = fd, whole
        return fd

    def _close_manifest(self) -> None:
        fd, self._manifest_fd = self._manifest_fd, None
        if fd is not None:
            os.close(fd)

    # -- reading -------------------------------------------------------------------------------------------

    def read(self, key: bytes, generation: int) -> tuple[SharedObject, bytes]:
        """The object and its payload, checked whole: KeyNotFoundError if there is no such file,
        ChecksumMismatchError naming the file and what is wrong with it, UnavailableError if it cannot be read."""
        path = self.path(key, generation)
        fd = _open_object(path, key, generation)
        try:
            obj = _checked_header(fd, path, key, generation)
            payload = _pread_all(fd, obj.size, HEADER_SIZE + len(key), path)
        except OSError as exc:
            raise _typed(exc, f"reading {path}") from exc
        finally:
            os.close(fd)
        if checksum_of(payload) != obj.checksum:
            raise ChecksumMismatchError(f"{path}: payload fails its checksum (damaged)")
        return obj, payload

    def read_into(self, key: bytes, generation: int, size: int, checksum: int, dest) -> None:
        """The payload of (key, generation) read straight into `dest` (a writable buffer of exactly `size`
        bytes), refused unless the file holds an object of that size and checksum (a placement's) and the
        bytes read match it; same errors as read. After an error `dest` holds nothing to use."""
        view = memoryview(dest).cast("B")
        if view.readonly or view.nbytes != size:
            raise InvalidArgumentError(f"read_into needs a writable buffer of {size} bytes, not a "
                                       f"{'read-only ' if view.readonly else ''}one of {view.nbytes}")
        path = self.path(key, generation)
        fd = _open_object(path, key, generation)
        try:
            obj = _checked_header(fd, path, key, generation)
            if obj.size != size or obj.checksum != checksum:
                raise ChecksumMismatchError(f"{path} holds {obj.size} bytes of checksum {obj.checksum:#x}; "
                                            f"expected {size} of {checksum:#x}")
            _preadv_all(fd, view, HEADER_SIZE + len(key), path)
        except OSError as exc:
            raise _typed(exc, f"reading {path}") from exc
        finally:
            os.close(fd)
        if checksum_of(view) != checksum:
            raise ChecksumMismatchError(f"{path}: payload fails its checksum (damaged)")

    # -- removing ------------------------------------------------------------------------------------------

    def remove_many(self, items: list) -> list[bool]:
        """Each object's file gone (items: SharedObject or (key, generation)), its REMOVED record appended
        first; for each, whether a file was there. A file that cannot be unlinked: BatchError after the others,
        its `results` each item's bool or error (the file is then unreferenced)."""
        self._writer()
        objects = [item if isinstance(item, SharedObject) else SharedObject(item[0], item[1], 0, 0, 0, 0, 0)
                   for item in items]
        for obj in objects:
            _check_key(obj.key)
        if not objects:
            return []
        try:
            self._append([pack_record(REMOVED, obj) for obj in objects])
        except OSError as exc:
            raise _typed(exc, f"recording the removal of {len(objects)} shared objects") from exc
        results: list = []
        for obj in objects:
            path = self.path(obj.key, obj.generation)
            # POSIX unlink: a reader that has the file open keeps reading all of it; only the name goes. (On
            # NFS the client renames an open file to .nfsXXXX and removes it at its last close.)
            try:
                os.unlink(path)
                results.append(True)
            except FileNotFoundError:
                results.append(False)
            except OSError as exc:
                results.append(_typed(exc, f"removing {path}"))
        raise_failures("remove", [obj.key for obj in objects], results)
        return results

    # -- adoption ------------------------------------------------------------------------------------------

    def scan(self, now_ms: int) -> Scan:
        """What every writer's manifest (this one's too, and those being appended to now: up to their last
        whole record) says the tier holds, without opening an object file."""
        manifests = []
        for name in sorted(os.listdir(self.manifests_dir)):
            if name.startswith(".") or not name.endswith(MANIFEST_SUFFIX):
                continue
            try:
                fd = os.open(os.path.join(self.manifests_dir, name), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                manifests.append(parse_records(_read_all(fd)))
            finally:
                os.close(fd)
        return fold(manifests, now_ms)

    def close(self) -> None:
        with self._manifest_lock:
            self._close_manifest()


_SYNC_THREADS = 16  # files of a batch written and fsynced at once: a file system commits them together
_sync_pool: ThreadPoolExecutor | None = None
_sync_pool_lock = threading.Lock()


def _syncing() -> ThreadPoolExecutor:
    """The threads a batch's files are written and fsynced on (one fsync at a time costs ~3 ms a file on a local
    disk here; sixteen at once, ~0.6 ms a file)."""
    global _sync_pool
    with _sync_pool_lock:
        if _sync_pool is None:
            _sync_pool = ThreadPoolExecutor(_SYNC_THREADS, thread_name_prefix="kvpool-shared-sync")
        return _sync_pool


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or not key or len(key) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"shared object key must be 1 to {MAX_KEY_BYTES} bytes, not {key!r:.80}")


def _typed(exc: OSError, doing: str) -> KvpoolError:
    cls = NoSpaceError if exc.errno in (errno.ENOSPC, errno.EDQUOT) else UnavailableError
    error = cls(f"{doing}: {exc.strerror or exc}")
    error.__cause__ = exc
    return error


def raise_failures(what: str, keys: list[bytes], results: list, tier: str = "shared") -> None:
    """BatchError if any of `results` (one per key) is an error: `errors` by key, `results` in order."""
    errors = {i: result for i, result in enumerate(results) if isinstance(result, KvpoolError)}
    if errors:
        first = next(iter(errors.values()))
        raise BatchError(f"{tier} {what}: {len(errors)} of {len(keys)} failed; first: {first}",
                         {keys[i].decode("utf-8", "surrogateescape"): e for i, e in errors.items()}, results)


def _make_dir(directory: str) -> None:
    """`directory` made with DIR_MODE (whatever the umask) and its name made durable, unless it exists."""
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(directory, DIR_MODE)
    _fsync_dir(os.path.dirname(directory))


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_all(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _open_object(path: str, key: bytes, generation: int) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeyNotFoundError(f"no shared file for key {key!r} generation {generation} ({path})") from None
    except OSError as exc:
        raise _typed(exc, f"opening {path}") from exc


def _checked_header(fd: int, path: str, key: bytes, generation: int) -> SharedObject:
    """The header of the open file at `path`, refused unless it names (key, generation) and the file's
    length is what it says."""
    length = os.fstat(fd).st_size
    try:
        obj = parse_header(os.pread(fd, _HEAD_READ, 0))
    except ChecksumMismatchError as exc:
        raise ChecksumMismatchError(f"{path}: {exc}") from None
    if obj.key != key or obj.generation != generation:
        raise ChecksumMismatchError(f"{path} holds key {obj.key!r} generation {obj.generation}, not {key!r} "
                                    f"generation {generation}")
    if length != obj.file_size:
        raise ChecksumMismatchError(f"{path} is {length} bytes; its header says {obj.file_size} (truncated "
                                    "or extended)")
    return obj


def _read_all(fd: int) -> bytes:
    """The file's bytes from its start to its end now (one buffer, sized by fstat)."""
    os.lseek(fd, 0, os.SEEK_SET)
    with io.FileIO(fd, "rb", closefd=False) as f:
        return f.readall()


def _pread_all(fd: int, size: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) == size:
        return data
    parts = [data]  # a read taken in pieces (over 2 GiB, or a file system that returns less)
    got = len(data)
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            raise ChecksumMismatchError(f"{path} ended {size - got} bytes short of its payload")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _preadv_all(fd: int, dest: memoryview, offset: int, path: str) -> None:
    got = 0
    while got < dest.nbytes:
        n = os.preadv(fd, [dest[got:]], offset + got)
        if not n:
            raise ChecksumMismatchError(f"{path} ended {dest.nbytes - got} bytes short of its payload")
        got += n
