"""The few libbpf calls BCC 0.26 does not expose: who is attached to a cgroup, detaching
programs another process loaded (a restarted agent detaching what its predecessor attached),
and replacing one in place (a restarted agent putting its own version where its predecessor's
ran).

libbpf.so.1 is always present where BCC is (libbcc links it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import cache

BPF_F_ALLOW_MULTI = 2
BPF_F_REPLACE = 4


class _AttachOpts(ctypes.Structure):
    # struct bpf_prog_attach_opts as libbpf 1.1 declares it (later versions append fields and
    # take a shorter ``sz`` as "the rest is zero").
    _fields_ = (
        ("sz", ctypes.c_size_t),
        ("flags", ctypes.c_uint32),
        ("replace_prog_fd", ctypes.c_int),
    )


class _ProgInfo(ctypes.Structure):
    # Leading fields of UAPI struct bpf_prog_info; the kernel copies min(len, sizeof).
    _fields_ = (
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16),
    )


class _MapInfo(ctypes.Structure):
    _fields_ = (("type", ctypes.c_uint32), ("id", ctypes.c_uint32))


@cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)
    lib.bpf_prog_query.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.POINTER(ctypes.c_uint32),
    ]
    lib.bpf_prog_get_fd_by_id.argtypes = [ctypes.c_uint32]
    lib.bpf_obj_get_info_by_fd.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint32),
    ]
    lib.bpf_prog_detach2.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.bpf_prog_attach_opts.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(_AttachOpts),
    ]
    lib.ring_buffer__epoll_fd.argtypes = [ctypes.c_void_p]
    lib.bpf_obj_get.argtypes = [ctypes.c_char_p]
    lib.bpf_prog_get_next_id.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
    return lib


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = -rc if rc != -1 else ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


def attached_prog_ids(cgroup_fd: int, attach_type: int) -> list[int]:
    """Ids of the programs attached directly to a cgroup for one attach type."""
    ids = (ctypes.c_uint32 * 64)()
    count = ctypes.c_uint32(len(ids))
    flags = ctypes.c_uint32(0)
    rc = _lib().bpf_prog_query(
        cgroup_fd, attach_type, 0, ctypes.byref(flags), ids, ctypes.byref(count)
    )
    _check(rc, "bpf_prog_query")
    return list(ids[: count.value])


def map_id(map_fd: int) -> int:
    """The kernel id of a map."""
    info = _MapInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    _check(
        _lib().bpf_obj_get_info_by_fd(map_fd, ctypes.byref(info), ctypes.byref(size)), "map info"
    )
    return int(info.id)


def prog_map_ids(prog_id: int) -> tuple[str, list[int]]:
    """(name, map ids) of a loaded program."""
    fd = _check(_lib().bpf_prog_get_fd_by_id(prog_id), f"bpf prog {prog_id}")
    try:
        ids = (ctypes.c_uint32 * 64)()
        info = _ProgInfo(nr_map_ids=len(ids), map_ids=ctypes.addressof(ids))
        size = ctypes.c_uint32(ctypes.sizeof(info))
        _check(
            _lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)), "prog info"
        )
        return info.name.decode(errors="replace"), list(ids[: min(info.nr_map_ids, len(ids))])
    finally:
        os.close(fd)


def prog_id(prog_fd: int) -> int:
    """The kernel id of a loaded program."""
    info = _ProgInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    _check(
        _lib().bpf_obj_get_info_by_fd(prog_fd, ctypes.byref(info), ctypes.byref(size)),
        "prog info",
    )
    return int(info.id)


def replace_prog(cgroup_fd: int, attach_type: int, prog_fd: int, old_prog_id: int) -> None:
    """Put the program ``prog_fd`` in the place of ``old_prog_id`` on a cgroup, atomically
    (BPF_F_REPLACE): no packet or connect runs with neither, or with both."""
    old = _check(_lib().bpf_prog_get_fd_by_id(old_prog_id), f"bpf prog {old_prog_id}")
    try:
        opts = _AttachOpts(
            sz=ctypes.sizeof(_AttachOpts),
            flags=BPF_F_ALLOW_MULTI | BPF_F_REPLACE,
            replace_prog_fd=old,
        )
        rc = _lib().bpf_prog_attach_opts(prog_fd, cgroup_fd, attach_type, ctypes.byref(opts))
        _check(rc, "bpf_prog_attach_opts(BPF_F_REPLACE)")
    finally:
        os.close(old)


def detach_prog_id(cgroup_fd: int, attach_type: int, prog_id: int) -> None:
    """Detach one program (by id) from a cgroup."""
    fd = _check(_lib().bpf_prog_get_fd_by_id(prog_id), f"bpf prog {prog_id}")
    try:
        _check(_lib().bpf_prog_detach2(fd, cgroup_fd, attach_type), "bpf_prog_detach2")
    finally:
        os.close(fd)


def ring_buffer_epoll_fd(manager: int) -> int:
    """The epoll fd of a libbpf ``struct ring_buffer`` (BCC's ring buffer manager)."""
    return _check(_lib().ring_buffer__epoll_fd(manager), "ring_buffer__epoll_fd")


def obj_get(path: os.PathLike[str] | str) -> int:
    """A file descriptor of the BPF object pinned at ``path`` (the caller closes it)."""
    return _check(_lib().bpf_obj_get(os.fsencode(path)), f"bpf_obj_get {path}")


def loaded_prog_ids() -> list[int]:
    """Ids of every BPF program loaded on this machine (attached or held by a process)."""
    ids: list[int] = []
    current = ctypes.c_uint32(0)
    while True:
        rc = _lib().bpf_prog_get_next_id(current.value, ctypes.byref(current))
        if rc != 0:
            err = -rc if rc != -1 else ctypes.get_errno()
            if err == errno.ENOENT:  # past the last one
                return ids
            raise OSError(err, f"bpf_prog_get_next_id: {os.strerror(err)}")
        ids.append(current.value)
