"""Triton's system shared memory extension: tensors that never travel through the socket.

A client on the same host (a sidecar in the pod) puts a tensor in a POSIX shared memory object,
registers a region of it once, and then names the region in each request instead of sending the
tensor; an output may be asked into a region too, and the answer carries its name in place of the
data. Inputs are read as views of the mapping, not copied; outputs are written straight into it.

Off unless the server is started with it (`kubetrt serve --shared-memory`): a registered region
lets whoever can reach the endpoint have the server read and write that memory object. The server
keeps each object open and checks its size before every read and write: memory past the end of a
mapping an object no longer covers (a client that shrank it) would kill the process, not fail a request.
"""
from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import BadRequest, NotFound
from .tensors import is_count

SHM_DIR = Path("/dev/shm")  # where shm_open(3) keeps POSIX shared memory objects on Linux
# a key is one name in SHM_DIR, with or without shm_open's leading slash: no path in it
_KEY = re.compile(r"/?(?!\.\.?$)[^/\x00]{1,255}")
REGION, BYTE_SIZE, OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
OFF = "system shared memory is off on this server (start kubetrt serve with --shared-memory)"


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lies (an input) or may be written (an output): `byte_size` bytes from
    `offset` in a registered region."""
    region: str
    byte_size: int
    offset: int = 0


def tensor_ref(params: Mapping[str, Any], what: str) -> TensorRef | None:
    """The shared memory a tensor's parameters name, None where they name none."""
    region = params.get(REGION)
    if region is None:
        if BYTE_SIZE in params or OFFSET in params:
            raise BadRequest(f"{what}: {BYTE_SIZE}/{OFFSET} without {REGION}")
        return None
    if not isinstance(region, str) or not region:
        raise BadRequest(f"{what}: {REGION} must be a region's name, got {region!r}")
    size, offset = params.get(BYTE_SIZE), params.get(OFFSET, 0)
    if is_count(size) and is_count(offset):
        return TensorRef(region, size, offset)
    raise BadRequest(f"{what}: {BYTE_SIZE} and {OFFSET} must be non-negative integers, got {size!r} and {offset!r}")


@dataclass(frozen=True)
class Region:
    name: str
    key: str
    offset: int  # into the memory object
    byte_size: int
    memory: memoryview  # the region's bytes in the mapping
    fd: int  # the object, open for its size

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def place(self, ref: TensorRef, what: str) -> memoryview:
        """The bytes `ref` names, checked to lie in the region and in the object as it is now."""
        if ref.offset + ref.byte_size > self.byte_size:
            raise BadRequest(f"{what}: {OFFSET} {ref.offset} + {BYTE_SIZE} {ref.byte_size} runs past the end of "
                             f"region {ref.region!r} ({self.byte_size} bytes)")
        end = self.offset + ref.offset + ref.byte_size
        try:
            size = os.fstat(self.fd).st_size
        except OSError:  # unregistered meanwhile (a codec thread's read)
            raise BadRequest(f"{what}: region {ref.region!r} was unregistered during the request") from None
        if end > size:
            raise BadRequest(f"{what}: region {ref.region!r} needs {self.key!r} to hold {end} bytes; it has "
                             f"shrunk to {size} since it was registered")
        return self.memory[ref.offset:ref.offset + ref.byte_size]

    def close(self) -> None:
        os.close(self.fd)


class SharedMemoryRegions:
    """The regions clients registered, by name. Unregistering drops the server's reference; a
    mapping stays until the last tensor viewing it is gone, so a request in flight keeps its data."""

    def __init__(self, directory: Path = SHM_DIR) -> None:
        self.directory = directory
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> Region:
        if not isinstance(name, str) or not name:
            raise BadRequest(f"a region needs a name, got {name!r}")
        if name in self._regions:
            raise BadRequest(f"shared memory region {name!r} is already registered (unregister it first)")
        if not isinstance(key, str) or _KEY.fullmatch(key) is None:
            raise BadRequest(f"region {name!r}: key {key!r} is no shared memory object's name; expected what "
                             f"shm_open was given, such as '/input0' (one name in {self.directory}, no path)")
        if not is_count(offset) or not is_count(byte_size):
            raise BadRequest(f"region {name!r}: offset and byte_size must be non-negative integers, "
                             f"got {offset!r} and {byte_size!r}")
        path = self.directory / key.lstrip("/")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise BadRequest(f"region {name!r}: cannot open shared memory object {key!r} ({e.strerror})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BadRequest(f"region {name!r}: {key!r} is not a shared memory object")
            if offset + byte_size > info.st_size:
                raise BadRequest(f"region {name!r}: offset {offset} + byte_size {byte_size} runs past the end of "
                                 f"{key!r} ({info.st_size} bytes)")
            mapping = mmap.mmap(fd, info.st_size) if info.st_size else None
        except BaseException:
            os.close(fd)
            raise
        memory = memoryview(mapping)[offset:offset + byte_size] if mapping is not None else memoryview(bytearray())
        region = self._regions[name] = Region(name, key, offset, byte_size, memory, fd)
        return region

    def unregister(self, name: str | None = None) -> None:
        """One region, or every one where `name` is None or empty; an unknown name is no error."""
        if name:
            found = self._regions.pop(name, None)
            dropped = [found] if found is not None else []
        else:
            dropped, self._regions = list(self._regions.values()), {}
        for region in dropped:
            region.close()  # the mapping stays while a tensor views it

    def status(self, name: str | None = None) -> list[Region]:
        if not name:
            return list(self._regions.values())
        return [self.get(name)]

    def get(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"no shared memory region {name!r} is registered; registered: {sorted(self._regions)}")
        return region

    def read(self, ref: TensorRef, what: str) -> memoryview:
        """The bytes an input names, as a read-only view of the mapping (the client's bytes are not
        the runtime's to change)."""
        return self._lookup(ref, what).place(ref, what).toreadonly()

    def check_room(self, ref: TensorRef, what: str) -> None:
        """That an output's place lies within its region (before the run, so a bad one costs none)."""
        self._lookup(ref, what).place(ref, what)

    def write(self, ref: TensorRef, data: bytes | memoryview, what: str) -> None:
        """An output's bytes into its place; refused where they do not fit it."""
        place = self._lookup(ref, what).place(ref, what)
        if len(data) > ref.byte_size:
            raise BadRequest(f"{what}: its {len(data)} bytes do not fit the {ref.byte_size} bytes of "
                             f"{BYTE_SIZE} given in region {ref.region!r}")
        place[:len(data)] = data

    def _lookup(self, ref: TensorRef, what: str) -> Region:
        region = self._regions.get(ref.region)
        if region is None:
            raise BadRequest(f"{what}: no shared memory region {ref.region!r} is registered; "
                             f"registered: {sorted(self._regions)}")
        return region


def regions_or_refuse(regions: SharedMemoryRegions | None, what: str) -> SharedMemoryRegions:
    """The server's regions, or the request refused where shared memory is off."""
    if regions is None:
        raise BadRequest(f"{what}: {OFF}")
    return regions
