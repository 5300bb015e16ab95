"""What a runtime needs to see: computed from the interpreter and its ELF files, never a list.

The interpreter is asked for its prefix, stdlib, extension-module dir and OpenSSL paths; the
shared libraries come from the ELF files themselves (:mod:`.elfdeps`: the interpreter, every
extension module of the runtime and of the built environment, their ``DT_NEEDED`` resolved as the
loader would, without running it); each path's symlink chain (``/lib64`` → ``usr/lib64`` on
merged-/usr systems) is recorded so the sandbox's root can recreate it. A built environment is
the tenant's: what its files name is resolved inside it and in the system's library directories
only. Results are cached on disk per (interpreter, environment) since both are immutable once
built, and the runtime's part in memory per interpreter, so a new environment reads only its own
files.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import blake3

from dsec_nodeagent.sandbox import elfdeps

_PROBE = """
import json, os, ssl, sys, sysconfig
paths = ssl.get_default_verify_paths()
print(json.dumps({
    "executable": os.path.realpath(sys.executable),
    "prefix": os.path.realpath(sys.base_prefix),
    "exec_prefix": os.path.realpath(sys.base_exec_prefix),
    "dynload": sysconfig.get_config_var("DESTSHARED") or "",
    "version": "%d.%d" % sys.version_info[:2],
    "ssl": [p for p in (paths.openssl_cafile, paths.openssl_capath) if p],
}))
"""

_LDD_BATCH = 64
_LOCALES = ("/usr/lib/locale/C.utf8", "/usr/lib/locale/C.UTF-8")
"""Where glibc looks for the locale of the sandbox's ``LANG=C.UTF-8`` (glibc 2.35+ ships it
as a directory; Debian and Ubuntu always have it). Without it ``setlocale`` falls back to
"C": Python then starts in its UTF-8 mode by a detour (about 0.2 ms of every start), and
every other program in the sandbox runs in the ASCII locale its ``LANG`` did not ask for."""
_VIEW_FORMAT = 4  # part of the disk cache's key: a view cached by an older rule is not reused
_MAX_LINKS = 40


class DiscoveryError(RuntimeError):
    """The view cannot be computed: the runtime cannot be inspected, or a built environment
    needs more than the node shows a sandbox (a library outside it and the system's library
    directories, or more work than the node's bound)."""


@dataclass(frozen=True)
class RuntimeView:
    """Host paths the sandbox's root must contain, at the same paths, read-only.

    Attributes:
        executable: real path of the interpreter binary (what ``python`` runs in the sandbox).
        version: ``major.minor`` of the interpreter.
        ro_dirs: directories to bind read-only (none inside another).
        ro_files: single files to bind read-only (e.g. a CA bundle outside ``ro_dirs``).
        symlinks: ``(path, target)`` links to recreate, parents before children.
    """

    executable: str
    version: str
    ro_dirs: list[str] = field(default_factory=list)
    ro_files: list[str] = field(default_factory=list)
    symlinks: list[tuple[str, str]] = field(default_factory=list)


def resolve_chain(path: str, depth: int = 0) -> tuple[str, list[tuple[str, str]]]:
    """Resolve ``path`` component by component, as the kernel does, returning its real path and
    the links crossed (a ``..`` after a link goes up from where the link led, not from the
    link's name).

    Raises:
        DiscoveryError: a symlink loop.
    """
    if depth > _MAX_LINKS:
        raise DiscoveryError(f"too many symlinks resolving {path}")
    current = "/"
    links: list[tuple[str, str]] = []
    for part in [p for p in path.split("/") if p]:
        if part == ".":
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            links.append((candidate, target))
            real, more = resolve_chain(
                target if target.startswith("/") else os.path.join(current, target), depth + 1
            )
            links += more
            current = real
        else:
            current = candidate
    return current, links


def _ldd(files: list[str]) -> set[str]:
    """Shared-library paths (as the loader names them) needed by ``files``."""
    libs: set[str] = set()
    for start in range(0, len(files), _LDD_BATCH):
        batch = files[start : start + _LDD_BATCH]
        proc = subprocess.run(
            ["ldd", *batch],
            capture_output=True,
            text=True,
            check=False,
            env={"LC_ALL": "C", "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
        for line in proc.stdout.splitlines():
            line = line.strip()
            if "=>" in line:
                target = line.split("=>", 1)[1].strip().split(" (", 1)[0]
                if target.startswith("/"):
                    libs.add(target)
            elif line.startswith("/") and " (" in line:
                libs.add(line.split(" (", 1)[0])
    return libs


_MAX_TREE_ENTRIES = 1_000_000
"""Entries a tree's walk for ELF files looks at before refusing the tree."""


def _elf_files(root: Path) -> list[str]:
    """Regular files named ``*.so*`` under ``root``, links not followed (an explicit stack:
    no recursion limit for a deep tree)."""
    found: list[str] = []
    stack, seen = [str(root)], 0
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > _MAX_TREE_ENTRIES:
                    raise DiscoveryError(f"{root}: more than {_MAX_TREE_ENTRIES} entries")
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif ".so" in entry.name and entry.is_file(follow_symlinks=False):
                    found.append(entry.path)  # (what ``rglob("*.so*")`` matched)
    return sorted(found)


def _inside(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _probe(interpreter: Path) -> dict[str, object]:
    try:
        proc = subprocess.run(
            [str(interpreter), "-I", "-c", _PROBE],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise DiscoveryError(f"runtime {interpreter} cannot be inspected: {exc}") from exc
    data: dict[str, object] = json.loads(proc.stdout)
    return data


def discover(interpreter: Path, extra: list[Path] | None = None) -> RuntimeView:
    """Compute the read-only view for ``interpreter`` plus ``extra`` ELF files or trees.

    Args:
        interpreter: the runtime's Python (a venv's ``bin/python`` resolves to its base).
        extra: built environments or binaries whose shared libraries the sandbox also needs.
            A directory is untrusted (a built environment's files come from any wheel): what
            its files need is looked for inside it and in the system's library directories
            only. A file is the node's own (e.g. ``/bin/sh``): resolved as the runtime's.
    """
    runtime = _runtime_part(interpreter)
    info = runtime.info
    prefixes = sorted({str(info["prefix"]), str(info["exec_prefix"])})
    covered = list(prefixes)
    resolver = elfdeps.Resolver(loader=runtime.loader)
    needed = set(runtime.needs)
    try:
        for item in extra or []:
            if item.is_dir():
                tree = os.path.realpath(item)
                needed |= _tenant_needs(resolver, item, tree)
                covered.append(tree)
            elif item.exists():
                real = str(item.resolve())
                needed |= _trusted_closure(resolver, [real]) | {str(item)}
    except elfdeps.BudgetExceeded as exc:
        raise DiscoveryError(
            f"{', '.join(map(str, extra or []))}: finding the shared libraries its files need "
            f"takes more than a node does for one sandbox ({exc}); no usual environment comes "
            "near that: leave out the packages the sandbox does not use"
        ) from None
    return _assemble(
        str(info["executable"]),
        str(info["version"]),
        prefixes,
        needed,
        [str(p) for p in info["ssl"]] if isinstance(info["ssl"], list) else [],
        covered,
        [p for p in _LOCALES if os.path.isdir(p)][:1],
    )


@dataclass(frozen=True)
class _Runtime:
    info: dict[str, object]  # the interpreter's answers to _PROBE
    needs: frozenset[str]  # the libraries it and its extension modules need
    loader: str | None  # its PT_INTERP: asked for the system's search directories


_RUNTIMES: dict[tuple[str, int, int, int], _Runtime] = {}
""":func:`_runtime_part` per interpreter (its real path, device, inode and mtime)."""


def _runtime_part(interpreter: Path) -> _Runtime:
    """The interpreter's facts, its loader and the libraries it and its extension modules
    need; computed once per interpreter in this process (a new environment does not read the
    runtime again)."""
    real = os.path.realpath(interpreter)
    try:
        st = os.stat(real)
    except OSError as exc:
        raise DiscoveryError(f"runtime {interpreter} cannot be inspected: {exc}") from exc
    key = (real, st.st_dev, st.st_ino, st.st_mtime_ns)
    known = _RUNTIMES.get(key)
    if known is not None:
        return known
    info = _probe(interpreter)
    elf = [str(info["executable"])]
    if info["dynload"] and os.path.isdir(str(info["dynload"])):
        elf += _elf_files(Path(str(info["dynload"])))
    own = elfdeps.read_dynamic(elf[0])
    loader = own.interp if own is not None else None
    needs = _trusted_closure(elfdeps.Resolver(loader=loader), elf)
    _RUNTIMES[key] = _Runtime(info, frozenset(needs), loader)
    return _RUNTIMES[key]


def _tenant_needs(resolver: elfdeps.Resolver, item: Path, tree: str) -> set[str]:
    """The system libraries a built environment's files need (``tree``: its real path). What
    they find inside it is shown with it; anything else must really live in a system library
    directory (the resolver only looks there: a backstop)."""
    system = resolver.system_real_dirs()
    needs: set[str] = set()
    for lib in resolver.closure(_elf_files(item), tree=tree):
        if resolver.inside(lib, tree):  # (the memo: the answer the search had)
            continue
        real = elfdeps.real_path(lib)
        if real is None or os.path.dirname(real) not in system:
            raise DiscoveryError(
                f"{item}: its files need {lib}, outside the environment and the system's "
                "library directories: not shown to a sandbox"
            )
        needs.add(lib)
    return needs


def _trusted_closure(resolver: elfdeps.Resolver, files: list[str]) -> set[str]:
    """:meth:`.elfdeps.Resolver.closure` of trusted files (the runtime's, the node's), with
    ``ldd``'s answer for each of them whose closure met a need this reader could not place (a
    loader rule it does not follow) or a file it could not read: never less than before."""
    start = len(resolver.unresolved)
    found = resolver.closure(files)
    puzzling = sorted({root for root, _, _ in resolver.unresolved[start:]})
    if puzzling:
        found |= _ldd(puzzling)
    return found


def _assemble(
    executable: str,
    version: str,
    prefixes: list[str],
    needed: set[str],
    ssl: list[str],
    covered: list[str],
    data_dirs: tuple[str, ...] | list[str] = (),
) -> RuntimeView:
    dirs = set(prefixes)
    files: set[str] = set()
    links: dict[str, str] = {}
    for path in sorted(needed | {executable}):
        real, chain = resolve_chain(path)
        if real != os.path.realpath(path):  # (a view bound by a wrong answer shows too much)
            raise DiscoveryError(f"{path}: resolved to {real}, the kernel says otherwise")
        links.update(chain)
        if not _inside(real, covered):
            dirs.add(os.path.dirname(real))
    for path in ssl:
        if not os.path.exists(path):
            continue
        real, chain = resolve_chain(path)
        links.update(chain)
        if os.path.isdir(real):
            dirs.add(real)
            for entry in os.scandir(real):  # capath holds links into the CA store
                if entry.is_symlink():
                    target_real, _ = resolve_chain(entry.path)
                    dirs.add(os.path.dirname(target_real))
        else:
            files.add(real)
    for path in data_dirs:
        real, chain = resolve_chain(path)
        links.update(chain)
        dirs.add(real)
    ro_dirs = _outermost(sorted(dirs))
    ro_files = sorted(f for f in files if not _inside(f, ro_dirs))
    symlinks = sorted(
        ((p, t) for p, t in links.items() if not _inside(p, ro_dirs)),
        key=lambda item: item[0].count("/"),
    )
    return RuntimeView(executable, version, ro_dirs, ro_files, symlinks)


def _outermost(dirs: list[str]) -> list[str]:
    kept: list[str] = []
    for d in sorted(dirs, key=len):
        if not _inside(d, kept):
            kept.append(d)
    return sorted(kept)


def discover_cached(interpreter: Path, extra: list[Path], cache_dir: Path) -> RuntimeView:
    """:func:`discover`, memoised on disk by the identity and mtime of every input."""
    key_parts = [f"view-format:{_VIEW_FORMAT}"]
    for path in [interpreter, *extra]:
        stat = path.stat() if path.exists() else None
        key_parts.append(f"{path.resolve()}:{stat.st_mtime_ns if stat else 0}")
    key = blake3.blake3("|".join(key_parts).encode()).hexdigest()[:32]
    cache_file = cache_dir / f"{key}.json"
    if cache_file.exists():
        data = json.loads(cache_file.read_text())
        return RuntimeView(
            data["executable"],
            data["version"],
            data["ro_dirs"],
            data["ro_files"],
            [(str(x[0]), str(x[1])) for x in data["symlinks"]],
        )
    view = discover(interpreter, extra)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # a name of its own: launches run at once, and two may discover the same runtime
    tmp = cache_file.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(asdict(view)))
    tmp.replace(cache_file)
    return view
