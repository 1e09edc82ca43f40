"""MooncakeDistributedStore on kvpool's Client: Mooncake Store's Python client surface, with its conventions.

Every call returns what Mooncake's does: 0 or a size for success and a negative code (codes.py) for failure,
b"" for a missing key of get, 1 / 0 for is_exist. Raw addresses are read and written only inside buffers
registered first (memory.py). What differs from Mooncake, method by method: docs/mooncake.md.
"""

import ctypes
import functools
import re

from kvpool.client import Client
from kvpool.errors import BatchError, KeyExistsError, KeyNotFoundError, KvpoolError
from kvpool.protocol.keys import MAX_LIST_LIMIT
from kvpool.security import auth

from . import codes, config, tensors
from .config import DEFAULT, ReplicateConfig
from .memory import ALLOCATED, RegisteredMemory, UnregisteredMemory


class BufferHandle(bytearray):
    """get_buffer's answer: the value's bytes (a buffer: memoryview(handle), torch.frombuffer(handle)), with
    Mooncake's ptr() and size()."""

    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self)) if len(self) else 0

    def size(self) -> int:
        return len(self)


def _code_on_error(method):
    """The method's result, or Mooncake's code for the error it raised (an unregistered address: -600)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._client is None:
            codes.log.warning("kvpool: %s before setup() or after close()", method.__name__)
            return codes.INVALID_PARAMS
        try:
            return method(self, *args, **kwargs)
        except UnregisteredMemory as exc:
            codes.log.warning("kvpool: %s", exc)
            return codes.INVALID_PARAMS
        except (KvpoolError, ValueError, TypeError) as exc:
            return codes.code_of(exc)

    return call


def _codes_on_error(method):
    """As _code_on_error, for a method answering one int per key: every key gets the code."""

    @functools.wraps(method)
    def call(self, keys, *args, **kwargs):
        keys = list(keys)
        outcome = _code_on_error(method)(self, keys, *args, **kwargs)
        return [outcome] * len(keys) if isinstance(outcome, int) else outcome

    return call


def _refuse_empty(key, value) -> None:
    """value: one buffer, or a list of the parts a value is made of."""
    size = sum(map(len, value)) if isinstance(value, list) else len(value)
    if not isinstance(key, str) or not key or not size:  # as Mooncake: no empty key, no empty value
        raise ValueError(f"a put needs a key and a value of at least one byte (key {key!r}, {size} bytes)")


class MooncakeDistributedStore:
    """Mooncake Store's client; the store is a kvpool cluster, named by setup()'s master_server_addr."""

    def __init__(self):
        self._client: Client | None = None
        self._setup: config.Setup | None = None
        self._memory = RegisteredMemory()

    # -- connecting

    def setup(self, *args, **kwargs) -> int:
        """setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
        rdma_devices, master_server_addr, ...) or setup({...}); master_server_addr is a kvpool master
        (HOST:PORT) or etcd://HOST:PORT. Returns 0, or a negative code with the cause logged."""
        try:
            setup = config.parse(args, kwargs)
        except ValueError as exc:
            codes.log.error("kvpool: setup: %s", exc)
            return codes.INVALID_PARAMS
        return self._connect(setup)

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's standalone client form: server_address names the kvpool master."""
        return self.setup("", "", mem_pool_size, local_buffer_size, "tcp", "", server_address)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 0) -> int:
        return 0  # Mooncake's second step of an old two-step setup: nothing left to do

    def _connect(self, setup: config.Setup) -> int:
        if self._client is not None:
            codes.log.error("kvpool: setup called twice on one store")
            return codes.INVALID_PARAMS
        try:
            credential = auth.caller_credential(setup.token)
            tenant = credential.tenant if credential is not None and credential.tenant else "default"
            if setup.tenant_id != tenant:
                codes.log.error("kvpool: setup names tenant %r but kvpool's token is %s: give the tenant's token "
                                "(`kvpool tenant create %s`) in KVPOOL_TOKEN_FILE", setup.tenant_id,
                                f"tenant {tenant!r}'s" if tenant != "default" else "no tenant's", setup.tenant_id)
                return codes.ILLEGAL_CLIENT
            client = Client(setup.master, etcd=setup.etcd, token=setup.token)
        except (KvpoolError, ValueError) as exc:
            codes.log.error("kvpool: setup: %s", exc)
            return codes.INVALID_PARAMS
        try:
            client.exists("kvpool-mooncake-setup")  # reach the cluster now, as Mooncake's setup does
        except KvpoolError as exc:
            client.close()
            codes.log.error("kvpool: setup: the cluster at %s did not answer: %s", setup.master or setup.etcd, exc)
            return codes.code_of(exc)
        self._client, self._setup = client, setup
        codes.log.info("kvpool: Mooncake client on kvpool %s", f"master {setup.master}" if setup.master
                       else f"cluster found through etcd {setup.etcd}")
        return codes.OK

    def close(self) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        self._memory.clear()
        return codes.OK

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 the cluster does not answer (Mooncake's values)."""
        if self._client is None:
            return 1
        try:
            self._client.exists("kvpool-mooncake-health", timeout=2)
        except KvpoolError:
            return 2
        return 0

    def get_hostname(self) -> str:
        return self._setup.local_hostname if self._setup else ""

    # -- registered memory

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            view = self._memory.register(buffer_ptr, size)
        except UnregisteredMemory as exc:
            codes.log.warning("kvpool: %s", exc)
            return codes.INVALID_PARAMS
        if self._client is not None:
            self._client.register_buffer(view)  # UCX registers its memory once, not per transfer
        return codes.OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return codes.OK if self._memory.unregister(buffer_ptr) else codes.INVALID_PARAMS

    def _view(self, address: int, size: int) -> memoryview:
        try:
            return self._memory.view(address, size)
        except UnregisteredMemory:
            return ALLOCATED.view(address, size)  # or memory MooncakeHostMemAllocator handed out

    def _views(self, addresses, sizes) -> list:
        if len(addresses) != len(sizes):
            raise UnregisteredMemory(f"{len(addresses)} addresses but {len(sizes)} sizes")
        return [self._view(address, size) for address, size in zip(addresses, sizes)]

    # -- puts: 0, or a negative code; a key already stored keeps its value and answers 0 (upsert replaces it)

    def _put(self, key, value, config_: ReplicateConfig, overwrite: bool) -> int:
        _refuse_empty(key, value)
        options = config_.put_options()
        try:
            if isinstance(value, list):
                self._client.put_parts(key, value, overwrite, **options)
            else:
                self._client.put(key, value, overwrite, **options)
        except KeyExistsError:
            pass
        return codes.OK

    def _batch_put(self, keys, values, config_: ReplicateConfig, overwrite: bool) -> list:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        results = [codes.OK] * len(keys)
        todo = []
        for i, (key, value) in enumerate(zip(keys, values)):
            try:
                _refuse_empty(key, value)
                todo.append(i)
            except ValueError as exc:
                results[i] = codes.code_of(exc)
        if not todo:
            return results
        batch_keys = [keys[i] for i in todo]
        batch_values = [values[i] for i in todo]
        parts = isinstance(batch_values[0], list)
        try:
            if parts:
                self._client.batch_put_parts(batch_keys, batch_values, overwrite, **config_.put_options())
            else:
                self._client.batch_put(batch_keys, batch_values, overwrite, **config_.put_options())
        except BatchError as exc:
            for i, key in zip(todo, batch_keys):
                error = exc.errors.get(key)
                if error is not None and not isinstance(error, KeyExistsError):
                    results[i] = codes.code_of(error)
        return results

    @_code_on_error
    def put(self, key: str, value, config: ReplicateConfig = DEFAULT) -> int:
        return self._put(key, memoryview(value), config, False)

    @_code_on_error
    def upsert(self, key: str, value, config: ReplicateConfig = DEFAULT) -> int:
        return self._put(key, memoryview(value), config, True)

    @_code_on_error
    def put_parts(self, key: str, *parts, config: ReplicateConfig = DEFAULT) -> int:
        return self._put(key, [memoryview(p) for p in parts], config, False)

    @_code_on_error
    def upsert_parts(self, key: str, *parts, config: ReplicateConfig = DEFAULT) -> int:
        return self._put(key, [memoryview(p) for p in parts], config, True)

    @_code_on_error
    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig = DEFAULT) -> int:
        return self._put(key, self._view(buffer_ptr, size), config, False)

    @_code_on_error
    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig = DEFAULT) -> int:
        return self._put(key, self._view(buffer_ptr, size), config, True)

    @_code_on_error
    def put_batch(self, keys: list, values: list, config: ReplicateConfig = DEFAULT) -> int:
        """One code for the batch: 0, or the first failed key's."""
        results = self._batch_put(list(keys), [memoryview(v) for v in values], config, False)
        return next((r for r in results if r != codes.OK), codes.OK)

    @_code_on_error
    def upsert_batch(self, keys: list, values: list, config: ReplicateConfig = DEFAULT) -> int:
        results = self._batch_put(list(keys), [memoryview(v) for v in values], config, True)
        return next((r for r in results if r != codes.OK), codes.OK)

    @_codes_on_error
    def batch_put_from(self, keys: list, buffer_ptrs: list, sizes: list, config: ReplicateConfig = DEFAULT) -> list:
        return self._batch_put(keys, self._views(buffer_ptrs, sizes), config, False)

    @_codes_on_error
    def batch_upsert_from(self, keys: list, buffer_ptrs: list, sizes: list,
                          config: ReplicateConfig = DEFAULT) -> list:
        return self._batch_put(keys, self._views(buffer_ptrs, sizes), config, True)

    @_codes_on_error
    def batch_put_from_multi_buffers(self, keys: list, all_buffer_ptrs: list, all_sizes: list,
                                     config: ReplicateConfig = DEFAULT) -> list:
        """Each key's value is its buffers, in order."""
        if len(all_buffer_ptrs) != len(keys) or len(all_sizes) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(all_buffer_ptrs)} lists of buffers")
        return self._batch_put(keys, [self._views(p, s) for p, s in zip(all_buffer_ptrs, all_sizes)], config, False)

    # -- gets

    def get(self, key: str) -> bytes:
        """The value, or b"" when the key is missing (or on any error, logged)."""
        value = self._get_one(key)
        return b"" if isinstance(value, int) else value

    def get_buffer(self, key: str) -> BufferHandle | None:
        value = self._get_one(key)
        return None if isinstance(value, int) else BufferHandle(value)

    @_code_on_error
    def _get_one(self, key) -> bytes:
        return self._client.get(key)

    def get_batch(self, keys: list) -> list:
        return [b"" if isinstance(v, int) else v for v in self._get_many(list(keys))]

    def batch_get_buffer(self, keys: list) -> list:
        return [None if isinstance(v, int) else BufferHandle(v) for v in self._get_many(list(keys))]

    @_codes_on_error
    def _get_many(self, keys: list) -> list:
        return self._read(keys, None)

    def _read(self, keys: list, dests: list | None) -> list:
        """Per key, its value (bytes) or size read into its dest, or its negative code."""
        try:
            if dests is None:
                results = self._client.batch_get(keys)
            elif dests and isinstance(dests[0], list):
                results = self._client.batch_get_into_parts(keys, dests)
            else:
                results = self._client.batch_get_into(keys, dests)
        except BatchError as exc:
            if exc.results is None:
                raise
            results = exc.results
        return [codes.OBJECT_NOT_FOUND if r is None else codes.code_of(r) if isinstance(r, BaseException) else r
                for r in results]

    @_code_on_error
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """The value's size, read into the front of the buffer; -600 when the buffer is smaller."""
        return self._client.get_into(key, self._view(buffer_ptr, size))

    @_codes_on_error
    def batch_get_into(self, keys: list, buffer_ptrs: list, sizes: list) -> list:
        return self._read(keys, self._views(buffer_ptrs, sizes))

    @_codes_on_error
    def batch_get_into_multi_buffers(self, keys: list, all_buffer_ptrs: list, all_sizes: list,
                                     prefer_alloc_in_same_node: bool = False) -> list:
        """Each key's value scattered into its buffers, whose sizes must add up to it; answers its size."""
        if len(all_buffer_ptrs) != len(keys) or len(all_sizes) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(all_buffer_ptrs)} lists of buffers")
        return self._read(keys, [self._views(p, s) for p, s in zip(all_buffer_ptrs, all_sizes)])

    @_code_on_error
    def get_size(self, key: str) -> int:
        return self._client.size(key)

    # -- lookups and removal

    @_code_on_error
    def is_exist(self, key: str) -> int:
        """1 when the key is stored, 0 when not, negative on error."""
        return int(self._client.exists(key))

    @_codes_on_error
    def batch_is_exist(self, keys: list) -> list:
        return [int(found) for found in self._client.batch_exists(keys)] if keys else []

    @_code_on_error
    def remove(self, key: str, force: bool = False) -> int:
        """0, or -704 for a key not stored. kvpool grants no read leases: nothing waits for `force`."""
        if not self._client.remove(key):
            raise KeyNotFoundError(f"key {key!r} not found")
        return codes.OK

    def batch_remove(self, keys: list, force: bool = False) -> list:
        return [self.remove(key, force) for key in keys]

    @_code_on_error
    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed: every key this client's credential reaches."""
        return self._remove_matching(lambda key: True)

    @_code_on_error
    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many objects whose keys the pattern matches (re.search) were removed."""
        pattern = re.compile(regex_pattern)
        return self._remove_matching(pattern.search)

    def _remove_matching(self, matches) -> int:
        removed = 0
        cursor = None
        while True:  # a page of keys at a time (kvpool refuses to remove the empty prefix in one call)
            keys, cursor = self._client.list_keys("", MAX_LIST_LIMIT, cursor)
            removed += sum(self._client.remove(key) for key in keys if matches(key))
            if cursor is None:
                return removed

    # -- tensors (torch), stored with a header of their dtype and shape (tensors.py)

    @_code_on_error
    def put_tensor(self, key: str, tensor) -> int:
        return self._put(key, tensors.parts(tensor), DEFAULT, False)

    @_code_on_error
    def upsert_tensor(self, key: str, tensor) -> int:
        return self._put(key, tensors.parts(tensor), DEFAULT, True)

    @_codes_on_error
    def batch_put_tensor(self, keys: list, tensors_list: list) -> list:
        return self._batch_put(keys, [tensors.parts(t) for t in tensors_list], DEFAULT, False)

    def get_tensor(self, key: str):
        """The tensor, or None when the key is missing or holds no tensor (logged)."""
        [tensor] = self.batch_get_tensor([key])
        return tensor

    def batch_get_tensor(self, keys: list) -> list:
        out = []
        for key, value in zip(keys, self._get_many(list(keys))):
            try:
                out.append(None if isinstance(value, int) else tensors.tensor_of(value))
            except ValueError as exc:
                codes.log.warning("kvpool: get_tensor of %r: %s", key, exc)
                out.append(None)
        return out

    def __getattr__(self, name: str):
        raise AttributeError(f"kvpool's MooncakeDistributedStore has no {name}(): docs/mooncake.md lists what it "
                             "provides")
