"""Which shared libraries ELF files need, read from their program headers: no loader is run.

:mod:`.discovery` used to run ``ldd`` over every extension module of the runtime and of each
built environment, as root: ~4 ms a file (77 files of a CPython's ``lib-dynload``: ~0.3 s of the
first sandbox of every runtime and every new environment on a node), and the host's dynamic
loader mapping a tenant's ``.so`` (an environment's files come from wheels anyone can publish).
Its answer also steered the sandbox's view: a library resolved anywhere on the host had its
directory bound into the sandbox, so a tenant's ``.so`` naming a path in ``DT_NEEDED``, or an
absolute ``DT_RUNPATH``, chose host directories to show.

This module reads what the loader reads (``PT_INTERP``, ``PT_DYNAMIC``: ``DT_NEEDED``,
``DT_RPATH``, ``DT_RUNPATH``) with bounded ``pread``s, and resolves each name as glibc's loader
does: the ``DT_RPATH`` of the requester and of the objects that loaded it (while the requester
has no ``DT_RUNPATH``), then ``DT_RUNPATH``, then the system's cache (``ldconfig -p``) and the
loader's system directories, keeping only a shared object of the requester's kind. A file of an
untrusted tree (``tree=``) is held to that tree and the system: a name with a slash, a search
path or a candidate whose real path leaves the tree, ``PT_INTERP``, and a system candidate whose
real directory is not one of the system's library directories are ignored, so its metadata can
add no other host directory to a sandbox's view. Each discovery has a budget (files, names,
lookups): a tree past it is refused, not searched for minutes.

Why not ``pyelftools``: it parses every section into Python objects (~1 ms a file) and is not
built to bound its work on a hostile file; three header tables and a string table are a few
:mod:`struct` reads here, each checked against the file's size.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

PT_LOAD, PT_DYNAMIC, PT_INTERP = 1, 2, 3
DT_NULL, DT_NEEDED, DT_STRTAB, DT_RPATH, DT_RUNPATH = 0, 1, 5, 15, 29
ET_EXEC, ET_DYN = 2, 3
EM_MIPS, EM_ARM = 8, 40
MAX_PHDRS = 512
MAX_DYN_BYTES = 64 << 10
MAX_NEEDED = 128
"""``DT_NEEDED`` names read from one file (a real one has a few dozen at most)."""
MAX_NAME = 255
"""A library's name is one file name."""
MAX_SEARCH = 32
"""Directories of one file's ``DT_RPATH`` or ``DT_RUNPATH``."""
MAX_PATH = 4096
MAX_TENANT_MISSES = 1000
FALLBACK_SYSTEM_DIRS = ("/lib64", "/usr/lib64", "/lib", "/usr/lib")
"""The loader's own directories when it cannot be asked (``ld.so --help``)."""


class BudgetExceeded(RuntimeError):
    """A discovery read more files or made more lookups than any real runtime needs."""


@dataclass(frozen=True)
class Dynamic:
    """What the loader reads from one ELF file.

    Attributes:
        kind: ``(class, data, machine, abi flags)``: only a library of the same kind satisfies
            a need (the flags count on ARM and MIPS only, where they tell the ABIs apart).
        shared: ``ET_DYN`` (a shared object, or a position-independent program).
        needed: ``DT_NEEDED`` names, in order, each once.
        rpath: ``DT_RPATH`` entries (the loader uses the last such tag).
        runpath: ``DT_RUNPATH`` entries (likewise).
        interp: ``PT_INTERP`` (the program's loader), or ``None``.
    """

    kind: tuple[int, int, int, int]
    shared: bool
    needed: tuple[str, ...] = ()
    rpath: tuple[str, ...] = ()
    runpath: tuple[str, ...] = ()
    interp: str | None = None


def read_dynamic(path: str) -> Dynamic | None:
    """The loader's view of ``path``; ``None`` when it is no regular ELF file, or a malformed
    one (the loader would refuse it too: it needs nothing then)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < 52:
            return None
        return _parse(fd, st.st_size)
    except (OSError, ValueError, struct.error):
        return None
    finally:
        os.close(fd)


def _read(fd: int, offset: int, size: int, file_size: int) -> bytes:
    if offset < 0 or size < 0 or offset + size > file_size:
        raise ValueError("outside the file")
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ValueError("short read")
    return data


def _parse(fd: int, size: int) -> Dynamic | None:
    head = _read(fd, 0, 64 if size >= 64 else 52, size)
    if head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return None
    wide, end = head[4] == 2, "<" if head[5] == 1 else ">"
    e_type, machine = struct.unpack_from(end + "HH", head, 16)
    if wide:
        (phoff,) = struct.unpack_from(end + "Q", head, 32)
        (flags,) = struct.unpack_from(end + "I", head, 48)
        phentsize, phnum = struct.unpack_from(end + "HH", head, 54)
        ph_fmt, ph_size = end + "IIQQQQ", 48  # type, flags, offset, vaddr, paddr, filesz
    else:
        (phoff,) = struct.unpack_from(end + "I", head, 28)
        (flags,) = struct.unpack_from(end + "I", head, 36)
        phentsize, phnum = struct.unpack_from(end + "HH", head, 42)
        ph_fmt, ph_size = end + "IIIIII", 24  # type, offset, vaddr, paddr, filesz, memsz
    kind = (head[4], head[5], machine, flags if machine in (EM_ARM, EM_MIPS) else 0)
    if e_type not in (ET_EXEC, ET_DYN) or phnum > MAX_PHDRS or phentsize < ph_size:
        return None
    table = _read(fd, phoff, phnum * phentsize, size)
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None
    interp = None
    for i in range(phnum):
        fields = struct.unpack_from(ph_fmt, table, i * phentsize)
        if wide:
            p_type, _, offset, vaddr, _, filesz = fields
        else:
            p_type, offset, vaddr, _, filesz, _ = fields
        if offset + filesz > size:
            return None
        if p_type == PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (offset, filesz)
        elif p_type == PT_INTERP and 0 < filesz <= MAX_PATH:
            interp = _text(_read(fd, offset, filesz, size))
    shared = e_type == ET_DYN
    if dynamic is None:
        return Dynamic(kind, shared, interp=interp)
    entry_fmt, entry_size = (end + "qQ", 16) if wide else (end + "iI", 8)
    offset, filesz = dynamic
    raw = _read(fd, offset, min(filesz, MAX_DYN_BYTES) // entry_size * entry_size, size)
    needed: list[int] = []
    paths: dict[int, int] = {}  # DT_RPATH / DT_RUNPATH: the last of each, as the loader
    strtab = None
    for tag, value in struct.iter_unpack(entry_fmt, raw):
        if tag == DT_NULL:
            break
        if tag == DT_STRTAB:
            strtab = _file_offset(loads, value)
        elif tag == DT_NEEDED:
            needed.append(value)
        elif tag in (DT_RPATH, DT_RUNPATH):
            paths[tag] = value
    if strtab is None:
        return Dynamic(kind, shared, interp=interp) if not (needed or paths) else None
    names: list[str] = []
    for value in needed:
        name = _string(fd, strtab + value, MAX_NAME, size)
        if name is None:
            return None
        if name not in names:
            names.append(name)
            if len(names) > MAX_NEEDED:
                return None
    search: dict[int, tuple[str, ...]] = {}
    for tag, value in paths.items():
        text = _string(fd, strtab + value, MAX_PATH, size)
        if text is None:
            return None
        entries = tuple(dict.fromkeys(p for p in text.split(":") if p))
        if len(entries) > MAX_SEARCH:
            return None
        search[tag] = entries
    return Dynamic(
        kind, shared, tuple(names), search.get(DT_RPATH, ()), search.get(DT_RUNPATH, ()), interp
    )


def _file_offset(loads: list[tuple[int, int, int]], vaddr: int) -> int | None:
    for start, offset, filesz in loads:
        if start <= vaddr < start + filesz:
            return offset + (vaddr - start)
    return None


def _string(fd: int, offset: int, limit: int, size: int) -> str | None:
    """The NUL-terminated string at ``offset``, at most ``limit`` bytes, or ``None``."""
    if offset >= size:
        return None
    return _text(os.pread(fd, min(limit + 1, size - offset), offset))


def _text(data: bytes) -> str | None:
    nul = data.find(b"\0")
    if nul < 0:
        return None
    try:
        return data[:nul].decode()
    except UnicodeDecodeError:
        return None


LD_SO_CACHE = "/etc/ld.so.cache"
_CACHES: dict[tuple[int, int] | None, dict[str, list[str]]] = {}
_SYSTEM_DIRS: dict[str | None, tuple[str, ...]] = {}


def system_cache() -> dict[str, list[str]]:
    """The dynamic loader's cache (``ldconfig -p``): each name, its paths in the cache's order.
    Empty when ``ldconfig`` is missing (the system directories still resolve). Read again only
    when ``/etc/ld.so.cache`` changed (do not modify the mapping returned)."""
    try:
        st = os.stat(LD_SO_CACHE)
        key: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)
    except OSError:
        key = None
    if key not in _CACHES:
        _CACHES.clear()
        _CACHES[key] = _read_system_cache()
    return _CACHES[key]


def _read_system_cache() -> dict[str, list[str]]:
    try:
        out = subprocess.run(
            ["ldconfig", "-p"],
            capture_output=True,
            text=True,
            check=False,
            env={"LC_ALL": "C", "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
        ).stdout
    except OSError:
        return {}
    cache: dict[str, list[str]] = {}
    for line in out.splitlines()[1:]:
        name, arrow, path = line.strip().partition(" => ")
        if arrow and path.startswith("/"):
            cache.setdefault(name.split(" (", 1)[0], []).append(path)
    return cache


def system_dirs(loader: str | None) -> tuple[str, ...]:
    """The loader's own search directories (``ld.so --help``: "system search path"), in order;
    :data:`FALLBACK_SYSTEM_DIRS` when the loader cannot say. Asked once per loader."""
    if loader not in _SYSTEM_DIRS:
        _SYSTEM_DIRS[loader] = _ask_loader(loader)
    return _SYSTEM_DIRS[loader]


def _ask_loader(loader: str | None) -> tuple[str, ...]:
    if loader:
        try:
            out = subprocess.run(
                [loader, "--help"],
                capture_output=True,
                text=True,
                check=False,
                timeout=10,
                env={"LC_ALL": "C"},
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        dirs = tuple(
            line.strip().split(" (", 1)[0]
            for line in out.splitlines()
            if line.strip().endswith("(system search path)")
        )
        if dirs:
            return dirs
    return FALLBACK_SYSTEM_DIRS


_ORIGIN = re.compile(r"\$(?:ORIGIN|\{ORIGIN\})(?=/|$)")


_Dir = tuple[str, "str | None"]  # a search directory, and the tree it is held to (None: trusted)


@dataclass(frozen=True)
class _Item:
    path: str
    tree: str | None  # the untrusted tree it belongs to, or None: trusted
    inherited: tuple[_Dir, ...]  # DT_RPATH directories of the objects that loaded it
    root: str  # the file whose closure reached it


class Resolver:
    """Shared-library closure of ELF files, as the loader would resolve it (``ldd`` without
    running the loader). One per discovery: it memoises what it read and counts its work.

    Args:
        cache: ``ldconfig -p``'s map (default: read now).
        loader: the runtime's loader (``PT_INTERP``), asked for its system directories.
        max_files: ELF files read, in all.
        max_lookups: candidate paths tried, in all.
    """

    def __init__(
        self,
        cache: dict[str, list[str]] | None = None,
        loader: str | None = None,
        max_files: int = 50_000,
        max_lookups: int = 200_000,
    ) -> None:
        self.cache = system_cache() if cache is None else cache
        self.system = system_dirs(loader)
        self.max_files, self.max_lookups = max_files, max_lookups
        self.files_read = self.lookups = 0
        self._trusted: dict[str, Dynamic | None] = {}  # system files: small, read once
        self._resolved: dict[tuple[object, ...], str | None] = {}
        self._system_real: set[str] | None = None
        self._inside: dict[tuple[str, str], bool] = {}
        self.tenant_misses = 0
        self.unresolved: list[tuple[str, str, str]] = []
        """``(root, requester, name)`` no directory held (the loader would fail on them too),
        or ``(root, path, "")`` for a trusted ELF file this reader refused."""

    def _dynamic(self, path: str, trusted: bool) -> Dynamic | None:
        if trusted and path in self._trusted:
            return self._trusted[path]
        self.files_read += 1
        if self.files_read > self.max_files:
            raise BudgetExceeded(f"more than {self.max_files} ELF files to read")
        info = read_dynamic(path)
        if trusted:
            self._trusted[path] = info
        return info

    def system_real_dirs(self) -> set[str]:
        """The real directories a tenant's need may be found in: the cache's and the loader's."""
        if self._system_real is None:
            dirs = {os.path.dirname(p) for ps in self.cache.values() for p in ps}
            real = (real_path(d) for d in (*dirs, *self.system))
            self._system_real = {d for d in real if d is not None}
        return self._system_real

    def closure(self, files: Iterable[str], tree: str | None = None) -> set[str]:
        """Every library ``files`` need, directly or not, and the loaders they name.

        ``tree``: the files are untrusted and that tree's: a need is looked for in the tree
        (through search paths whose real path stays in it) and in the system's library
        directories only, and ``PT_INTERP`` is not followed. ``None``: trusted files (the
        runtime's, the node's).

        Raises:
            BudgetExceeded: past the resolver's budget.
        """
        real_tree = os.path.realpath(tree) if tree is not None else None
        found: set[str] = set()
        queue = [_Item(f, real_tree, (), f) for f in files]
        seen: set[tuple[object, ...]] = set()
        while queue:
            item = queue.pop()
            try:
                st = os.stat(item.path)
            except OSError:
                continue
            # (what a file needs depends on the RPATH it inherited and on whose it is)
            mark = (st.st_dev, st.st_ino, item.tree, item.inherited)
            if mark in seen:
                continue
            seen.add(mark)
            info = self._dynamic(item.path, trusted=item.tree is None)
            if info is None:
                if item.tree is None and _is_elf(item.path):
                    self.unresolved.append((item.root, item.path, ""))
                continue
            if item.tree is None and info.interp and os.path.isabs(info.interp):
                found.add(info.interp)
            real = real_path(item.path)
            if real is None:  # (gone, or past the kernel's link limit)
                continue
            origin = os.path.dirname(real)
            own_rpath = () if info.runpath else _expand_all(info.rpath, origin)
            own = tuple((d, item.tree) for d in own_rpath)
            chain = tuple(dict.fromkeys((*own, *item.inherited)))  # (a repeat finds nothing new)
            inherited = chain if not info.runpath else ()
            runpath = tuple((d, item.tree) for d in _expand_all(info.runpath, origin))
            self._count(len(inherited) + len(runpath))  # (a chain's RPATHs add up: counted)
            search = tuple(
                (d, t) for d, t in (*inherited, *runpath) if t is None or self.inside(d, t)
            )
            for name in info.needed:
                lib = self._resolve(name, info, search, item.tree)
                if lib is None:
                    # (only a trusted root's misses are asked of ldd; a tenant's few are kept
                    # for the log, not 128 names of each of 50 000 files)
                    if item.tree is None or self.tenant_misses < MAX_TENANT_MISSES:
                        self.unresolved.append((item.root, item.path, name))
                    self.tenant_misses += item.tree is not None
                    continue
                found.add(lib)
                # a library in the tree is the tenant's, whoever asked for it
                child_tree = real_tree if real_tree and self.inside(lib, real_tree) else None
                queue.append(_Item(lib, child_tree, chain, item.root))
        return found

    def inside(self, path: str, tree: str) -> bool:
        """:func:`inside`, memoised and counted (a link chain costs the kernel's 40 at most)."""
        key = (path, tree)
        hit = self._inside.get(key)
        if hit is None:
            self._count(1)
            hit = self._inside[key] = inside(path, tree)
        return hit

    def _count(self, lookups: int) -> None:
        self.lookups += lookups
        if self.lookups > self.max_lookups:
            raise BudgetExceeded(f"more than {self.max_lookups} library lookups")

    def _resolve(
        self, name: str, info: Dynamic, search: tuple[_Dir, ...], tree: str | None
    ) -> str | None:
        if not name or name in (".", ".."):
            return None
        if "/" in name:  # a path, as the loader takes it: only a trusted file's
            return name if tree is None and self._fits(name, info, None) else None
        key = (name, info.kind, search, tree)  # (a trusted answer is no tenant's answer)
        if key not in self._resolved:
            self._resolved[key] = self._search(name, info, search, tree)
        return self._resolved[key]

    def _search(
        self, name: str, info: Dynamic, search: tuple[_Dir, ...], tree: str | None
    ) -> str | None:
        for directory, held in search:
            candidate = os.path.join(directory, name)
            if self._fits(candidate, info, held):
                return candidate
        system = None if tree is None else self.system_real_dirs()
        for candidate in self.cache.get(name, ()):
            if self._fits(candidate, info, None, system):
                return candidate
        for directory in self.system:
            candidate = os.path.join(directory, name)
            if self._fits(candidate, info, None, system):
                return candidate
        return None

    def _fits(
        self,
        candidate: str,
        requester: Dynamic,
        tree: str | None,
        system: set[str] | None = None,
    ) -> bool:
        """Whether the loader would take ``candidate`` for ``requester``: checked where it
        must stay (``tree``, or the ``system`` directories) before it is opened."""
        self._count(1)
        if tree is not None and not self.inside(candidate, tree):
            return False
        if system is not None:
            real = real_path(candidate)
            if real is None or os.path.dirname(real) not in system:
                return False
        if not os.path.isfile(candidate):
            return False
        info = self._dynamic(candidate, trusted=tree is None)
        return info is not None and info.shared and info.kind == requester.kind


def _expand_all(entries: tuple[str, ...], origin: str) -> tuple[str, ...]:
    return tuple(d for d in (_expand(e, origin) for e in entries) if d is not None)


def _expand(entry: str, origin: str) -> str | None:
    """A search path entry with ``$ORIGIN`` expanded; ``None`` for one with another token
    (``$LIB``, ``$PLATFORM``: skipped, as a sandbox's view need not guess them) or relative."""
    text = _ORIGIN.sub(origin.replace("\\", "\\\\"), entry)
    if "$" in text or not text.startswith("/"):
        return None
    return os.path.normpath(text)


def inside(path: str, tree: str) -> bool:
    """Whether ``path``'s real path is ``tree`` (a real path) or below it: ``False`` when it
    does not exist, or the kernel will not resolve it (ELOOP past 40 links, too long)."""
    real = real_path(path)
    return real is not None and (real == tree or real.startswith(tree.rstrip("/") + "/"))


def real_path(path: str) -> str | None:
    """``path`` resolved by the kernel (its link limit, no Python recursion), or ``None``."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    finally:
        os.close(fd)


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False
