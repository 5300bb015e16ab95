"""The git-ignore-aware code bundle used everywhere (submit, snapshots, verified runs).

A bundle is the set of files a user means by "my code": every file under a root directory except
``.git``, files git ignores, the spec's ``exclude_patterns`` and :data:`DEFAULT_EXCLUDES`. It comes
as a manifest (path, size, mode, BLAKE3 of every file; git commit/path/dirty state) and a
deterministic archive (tar with fixed owners and mtimes, zstd-compressed), so the same tree always
yields the same bytes and the bundle is content-addressed by the BLAKE3 of the archive.

Symlinks are stored as links (their target text), never followed; extraction refuses absolute or
``..`` paths, special files, and any write through a symlink, so an archive cannot escape ``dest``:
every directory is opened component by component with ``O_NOFOLLOW`` relative to the directory
above it (:func:`open_real_dir`), never by path. Sockets, FIFOs and device files are not code:
they are left out of a bundle and listed in :attr:`Bundle.skipped`.

Bounds: a tree whose files add up to more than ``max_size`` (the spec's ``include_code.max_size``,
:data:`DEFAULT_MAX_SIZE` when unset) is refused when bundled, naming its largest files; extraction
counts the bytes it writes (whatever the tar headers claim) and the members it creates, and
refuses an archive that expands past ``max_size`` or holds more than :data:`MAX_MEMBERS` entries.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Annotated, BinaryIO, Literal, cast

import blake3
import msgspec
import pathspec
import zstandard
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    GetPydanticSchema,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from dsec_core import canonical

__all__ = [
    "DEFAULT_EXCLUDES",
    "DEFAULT_MAX_SIZE",
    "MAX_MEMBERS",
    "MAX_SIZE_LIMIT",
    "Bundle",
    "BundleError",
    "CodeManifest",
    "FileEntry",
    "FileList",
    "GitInfo",
    "TreeEntry",
    "archive_bound",
    "build_bundle",
    "check_names",
    "declared_max_size",
    "extract_bundle",
    "file_entry",
    "git_info",
    "hash_file",
    "list_tree",
    "open_real_dir",
    "read_members",
    "scan_tree",
]

#: Excluded from every bundle: build and tool caches, virtualenvs, OS litter and DSec's own state
#: (``.dsec/`` holds private keys). Gitignore syntax, matched at any depth.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".git/",
    ".dsec/",
    "__pycache__/",
    "*.pyc",
    "*.pyo",
    ".venv/",
    "node_modules/",
    ".mypy_cache/",
    ".pytest_cache/",
    ".ruff_cache/",
    ".hypothesis/",
    ".tox/",
    ".nox/",
    ".ipynb_checkpoints/",
    "*.egg-info/",
    ".coverage",
    ".DS_Store",
    "Thumbs.db",
    "*.swp",
)

#: The expanded size a bundle may have when the spec sets no ``include_code.max_size``.
DEFAULT_MAX_SIZE = 256 * 2**20
#: The largest ``include_code.max_size`` a spec may ask for.
MAX_SIZE_LIMIT = 4 * 2**30
#: Files, links and directories an archive may create when extracted (an inode bound).
MAX_MEMBERS = 100_000


def archive_bound(max_size: int) -> int:
    """The most bytes a bundle's archive may take when its files may add up to ``max_size``
    (``include_code.max_size``): the files, zstd's framing of incompressible data, and tar's
    headers. The client refuses to build a larger archive, and every reader refuses to fetch
    one (a tenant that stores a huge object under its own key cannot make a shared service
    read it)."""
    return max_size + max_size // 64 + 16 * 2**20


BUNDLE_PREFIX = "bundles/"
"""Where code bundles are stored in the DSec bucket: ``bundles/<tenant>/<BLAKE3>.tar.zst``."""


def bundle_key(tenant: str, digest: str) -> str:
    """Where tenant ``tenant``'s bundle of BLAKE3 ``digest`` is stored: under the tenant, so a
    reference to another tenant's bundle (copied off the bus) is refused by the policy
    service (:func:`bundle_of_tenant`)."""
    return f"{BUNDLE_PREFIX}{tenant}/{digest}.tar.zst"


def bundle_of_tenant(key: str, tenant: str) -> bool:
    """Whether object ``key`` is one of tenant ``tenant``'s bundles (:func:`bundle_key`)."""
    own = f"{BUNDLE_PREFIX}{tenant}/"
    return key.startswith(own) and "/" not in key[len(own) :] and ".." not in key


_LARGEST_SHOWN = 5

_GIT_TIMEOUT_S = 60
_ZSTD_LEVEL = 3
_READ_BLOCK = 1 << 20

Kind = Literal["file", "symlink"]


class BundleError(ValueError):
    """A tree cannot be bundled or an archive cannot be extracted; the message names the path."""


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One file of a code manifest.

    A frozen msgspec struct, not a pydantic model: a snapshot's manifest holds one per file
    (thousands), and reading it builds them all. msgspec decodes and checks 5,000 of them in
    ~2.2 ms where pydantic took ~6.5 ms, most of it making the model instances; a restore on a
    cold node waits for that. The rules are the same: every field typed, no other member,
    the mode one a manifest records (:meth:`__post_init__`, run on decoding and on
    construction). Inside a pydantic model use :data:`FileList` for the tuple of them.

    Fields:
        path: POSIX path relative to the bundle root.
        kind: ``file`` or ``symlink``.
        size: Bytes of content (of the target text for a symlink).
        mode: 0o644 or 0o755 for files (as git records it), 0o777 for links.
        blake3: BLAKE3 hex of the content (of the target text for a link).
        target: Link target, for symlinks.
    """

    path: str
    kind: Kind
    size: int
    mode: int
    blake3: str
    target: str | None = None

    def __post_init__(self) -> None:
        # Decoding checks the types; construction in Python does not, so they are checked
        # here too (a float size would be signed and never read back).
        if not (
            type(self.size) is int
            and type(self.mode) is int
            and type(self.path) is str
            and type(self.blake3) is str
            and (self.target is None or type(self.target) is str)
        ):
            got = ", ".join(type(getattr(self, f)).__name__ for f in self.__struct_fields__)
            raise TypeError(
                f"file entry {self.path!r}: path, blake3 and target (or None) are str, size "
                f"and mode int; got {got}"
            )
        # A manifest names only these modes (list_tree records them so): anything else, such
        # as a setuid bit, would be handed to whoever restores the tree as root.
        allowed = _MODES.get(self.kind) if type(self.kind) is str else None
        if allowed is None:
            raise ValueError(f"kind {self.kind!r} of {self.path!r}: 'file' or 'symlink'")
        if self.mode not in allowed:
            raise ValueError(
                f"mode {self.mode:#o} of {self.path!r}: a {self.kind} is recorded as "
                + " or ".join(f"{m:#o}" for m in sorted(allowed))
            )


_FILE_MODES = frozenset({0o644, 0o755})
_LINK_MODES = frozenset({0o777})
_MODES: dict[object, frozenset[int]] = {"file": _FILE_MODES, "symlink": _LINK_MODES}
_FILES_TYPE = tuple[FileEntry, ...]


def _files_in(value: object) -> tuple[FileEntry, ...]:
    """A :data:`FileList` from what pydantic was given: our own tuple as it is, anything
    else (a list of mappings parsed from JSON, a mixed list) converted and checked."""
    if type(value) is tuple and all(type(f) is FileEntry for f in value):
        return value
    try:
        return msgspec.convert(value, _FILES_TYPE)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Invalid enum value"):  # (msgspec names no valid value: the kind)
            text += ", valid: 'file', 'symlink'"
        raise ValueError(text) from None


def _files_out(files: tuple[FileEntry, ...]) -> list[dict[str, object]]:
    return msgspec.to_builtins(files)  # type: ignore[no-any-return]


def _files_schema(source: object, handler: GetCoreSchemaHandler) -> CoreSchema:
    return core_schema.no_info_plain_validator_function(
        _files_in,
        serialization=core_schema.plain_serializer_function_ser_schema(_files_out),
    )


def _files_json_schema(schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
    row = msgspec.json.schema(FileEntry)
    defs = row.pop("$defs", {})
    return {"type": "array", "items": defs.get("FileEntry", row)}


#: The type of a pydantic field holding manifest rows: a tuple of :class:`FileEntry`, given as
#: such or as a list of mappings (checked by msgspec), written out as a list of objects in
#: field order (the bytes pydantic wrote for the model it replaces, so signatures still match).
FileList = Annotated[
    tuple[FileEntry, ...],
    GetPydanticSchema(_files_schema, _files_json_schema),
]


class GitInfo(BaseModel):
    """Where the bundled tree sits in git, when it is in a work tree."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    commit: str | None = Field(description="HEAD commit, None before the first commit")
    branch: str | None = Field(description="Current branch, None when detached")
    path: str = Field(description="The bundle root relative to the repository top ('' = top)")
    dirty: bool = Field(description="Uncommitted or untracked (non-ignored) changes under the root")


class CodeManifest(BaseModel):
    """What a bundle contains: every file with its hash, plus git state and the excludes used."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    files: FileList
    git: GitInfo | None = None
    exclude_patterns: tuple[str, ...] = Field(
        default=(), description="The user's patterns (DEFAULT_EXCLUDES always apply too)"
    )

    @property
    def total_size(self) -> int:
        """Sum of the sizes of every file."""
        return sum(f.size for f in self.files)

    @property
    def tree_digest(self) -> str:
        """BLAKE3 of the canonical file list: identity of the content, whatever the compression."""
        rows = [[f.path, f.kind, f.mode, f.size, f.blake3, f.target] for f in self.files]
        return blake3.blake3(canonical.canonical_bytes(rows)).hexdigest()

    def by_path(self) -> dict[str, FileEntry]:
        """Return the files keyed by path."""
        return {f.path: f for f in self.files}


@dataclass(frozen=True, slots=True)
class TreeEntry:
    """A file selected for a bundle, with the stat data needed to cache its hash."""

    path: str
    root: str
    kind: Kind
    size: int
    mode: int
    target: str | None
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int

    @property
    def abspath(self) -> Path:
        """The file's absolute path."""
        return Path(self.root, self.path)


@dataclass(frozen=True)
class Bundle:
    """A built bundle: its manifest and archive, content-addressed by ``digest``."""

    manifest: CodeManifest
    digest: str
    size: int
    data: bytes | None = None
    path: Path | None = None
    skipped: tuple[str, ...] = ()
    """Special files left out (``path (fifo)``): sockets, FIFOs and devices are not code."""

    def read(self) -> bytes:
        """Return the archive bytes (from memory or from ``path``)."""
        if self.data is not None:
            return self.data
        assert self.path is not None
        return self.path.read_bytes()


# --- selecting files ------------------------------------------------------------------------


class _Excludes:
    """Gitignore-style patterns, matched with one combined regex when none is a negation.

    pathspec tests each pattern in turn; a tree of thousands of files against the default list
    is matched several times faster as one alternation (same regexes, same verdicts).
    """

    def __init__(self, lines: Sequence[str]) -> None:
        self.spec = pathspec.GitIgnoreSpec.from_lines(lines)
        regexes = [getattr(p, "regex", None) for p in self.spec.patterns if p.include is not None]
        negated = any(p.include is False for p in self.spec.patterns)
        self._combined: re.Pattern[str] | None = None
        if not negated and all(r is not None for r in regexes):
            parts = [_NAMED_GROUP.sub("(?:", r.pattern) for r in regexes if r is not None]
            self._combined = re.compile("|".join(f"(?:{p})" for p in parts) or "(?!)")
        # Patterns without an inner slash (``*.pyc``, ``__pycache__/``: all the defaults) match
        # one path component, whatever the directories above it. A walk that never enters an
        # excluded directory may then decide on the name alone, and names repeat (``mod.py``,
        # ``__init__.py``): each is matched once per listing.
        self._by_name: dict[str, bool] | None = (
            {} if self._combined is not None and all(map(_name_only, lines)) else None
        )

    def match(self, rel: str) -> bool:
        """True when ``rel`` (a directory ends with ``/``) is excluded."""
        if self._combined is not None:
            return self._combined.search(rel) is not None
        return bool(self.spec.match_file(rel))

    def match_child(self, rel: str, name: str) -> bool:
        """:meth:`match` of ``rel`` (ending in ``name``; a directory: both end with ``/``),
        for a walk whose parent directories of ``rel`` were matched and kept."""
        if self._by_name is None:
            return self.match(rel)
        verdict = self._by_name.get(name)
        if verdict is None:
            verdict = self._by_name[name] = self.match(name)
        return verdict


def _name_only(line: str) -> bool:
    """True for a pattern line that matches a single path component (no inner slash, no
    escape, no ``**``), or a blank or comment line."""
    body = line.strip()
    if not body or body.startswith("#"):
        return True
    return "/" not in body.rstrip("/") and "\\" not in body and "**" not in body


_NAMED_GROUP = re.compile(r"\(\?P<\w+>")


def _exclude_spec(exclude_patterns: Sequence[str]) -> _Excludes:
    for i, pattern in enumerate(exclude_patterns):
        if "\0" in pattern or "\n" in pattern:
            raise BundleError(f"exclude_patterns[{i}]: {pattern!r} contains a NUL or newline")
    return _Excludes([*DEFAULT_EXCLUDES, *(p for p in exclude_patterns if p.strip())])


def list_tree(
    root: Path, exclude_patterns: Sequence[str] = (), *, skipped: list[str] | None = None
) -> list[TreeEntry]:
    """Return the files a bundle of ``root`` contains, sorted by path, without reading them.

    Args:
        root: Directory to bundle.
        exclude_patterns: Extra gitignore-style patterns (the spec's ``exclude_patterns``).
        skipped: When given, receives each special file left out, as ``path (kind)``.

    Raises:
        BundleError: ``root`` is not a directory, or a pattern is malformed.
    """
    root = Path(root).absolute()
    if not root.is_dir():
        raise BundleError(f"{root}: not a directory")
    excludes = _exclude_spec(exclude_patterns)
    base = str(root)
    if _git_toplevel(root) is None:
        entries: list[TreeEntry] = []
        _walk_dir(base, "", [], excludes, entries, skipped)
    else:
        entries = [
            e
            for rel in _git_paths(root)
            if not excludes.match(rel) and (e := _tree_entry(base, rel, skipped)) is not None
        ]
    entries.sort(key=lambda e: e.path)
    if skipped is not None:
        skipped.sort()
    return entries


def check_names(entries: Sequence[TreeEntry]) -> None:
    """Refuse a file whose name or link target is not UTF-8 (a name made of raw bytes, read
    with ``surrogateescape``): a manifest is JSON and records UTF-8 text, so such a name
    could be neither signed nor stored. Checked once for the whole tree (one pass in C when
    every name is ASCII, as code's names almost always are).

    Raises:
        BundleError: naming the file, its name's bytes, and what to do.
    """
    texts = [e.path for e in entries]
    texts += [e.target for e in entries if e.target is not None]
    if "".join(texts).isascii():
        return
    for e in entries:
        for what, text in (("name", e.path), ("link target", e.target)):
            if text is None or text.isascii():
                continue
            try:
                text.encode()
            except UnicodeEncodeError:
                shown = "" if text is e.path else f" ({os.fsencode(text)!r})"
                raise BundleError(
                    f"{os.fsencode(e.path)!r}: the file's {what} is not UTF-8{shown}, and a "
                    "manifest records names as UTF-8 text: rename or remove it, or exclude it "
                    "(--exclude, or the spec's include_code.exclude_patterns)"
                ) from None


_SPECIAL_KINDS = (
    (stat.S_ISFIFO, "fifo"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def special_kind(mode: int) -> str:
    """What a special file is, in words (``fifo``, ``socket``, ...)."""
    return next((name for test, name in _SPECIAL_KINDS if test(mode)), "special file")


def _entry_from_stat(
    root: str, rel: str, st: os.stat_result, skipped: list[str] | None = None
) -> TreeEntry | None:
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(os.path.join(root, rel))
        return TreeEntry(
            rel, root, "symlink", len(os.fsencode(target)), 0o777, target,
            st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
        )  # fmt: skip
    if not stat.S_ISREG(st.st_mode):
        if skipped is not None and not stat.S_ISDIR(st.st_mode):
            skipped.append(f"{rel} ({special_kind(st.st_mode)})")
        return None  # sockets, fifos, devices: not code
    mode = 0o755 if st.st_mode & 0o111 else 0o644
    return TreeEntry(
        rel, root, "file", st.st_size, mode, None,
        st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
    )  # fmt: skip


def _tree_entry(root: str, rel: str, skipped: list[str] | None = None) -> TreeEntry | None:
    try:
        st = os.lstat(os.path.join(root, rel))
    except FileNotFoundError:
        return None  # tracked by git but deleted in the work tree
    return _entry_from_stat(root, rel, st, skipped)


def _walk_paths(root: Path, excludes: _Excludes) -> list[str]:
    """List files outside git, honouring every ``.gitignore`` on the way down."""
    out: list[TreeEntry] = []
    _walk_dir(str(root), "", [], excludes, out)
    return [e.path for e in out]


def _walk_dir(
    root: str,
    rel_dir: str,
    specs: list[tuple[str, pathspec.GitIgnoreSpec]],
    excludes: _Excludes,
    out: list[TreeEntry],
    skipped: list[str] | None = None,
) -> None:
    here = os.path.join(root, rel_dir) if rel_dir else root
    gitignore = os.path.join(here, ".gitignore")
    if os.path.isfile(gitignore) and not os.path.islink(gitignore):
        lines = Path(gitignore).read_text(errors="replace").splitlines()
        specs = [*specs, (rel_dir, pathspec.GitIgnoreSpec.from_lines(lines))]
    with os.scandir(here) as it:
        children = list(it)
    for child in children:
        name = child.name
        rel = f"{rel_dir}/{name}" if rel_dir else name
        is_dir = child.is_dir(follow_symlinks=False)
        probe, name_probe = (rel + "/", name + "/") if is_dir else (rel, name)
        if (
            name == ".git"
            or excludes.match_child(probe, name_probe)
            or (specs and _gitignored(probe, specs))
        ):
            continue
        if is_dir:
            _walk_dir(root, rel, specs, excludes, out, skipped)
        elif (
            entry := _entry_from_stat(root, rel, child.stat(follow_symlinks=False), skipped)
        ) is not None:
            out.append(entry)


def _gitignored(rel: str, specs: list[tuple[str, pathspec.GitIgnoreSpec]]) -> bool:
    # The deepest .gitignore with an opinion wins, as in git.
    for base, spec in reversed(specs):
        sub = rel[len(base) + 1 :] if base else rel
        verdict = spec.check_file(sub).include
        if verdict is not None:
            return verdict
    return False


# --- git ------------------------------------------------------------------------------------


def _git(root: Path, *args: str, config: Sequence[str] = ()) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    # The tree may belong to an agent: never let its .git/config run a program (fsmonitor).
    cmd = ["git", "-c", "core.fsmonitor=false", *config, "-C", str(root), *args]
    return subprocess.run(cmd, capture_output=True, env=env, timeout=_GIT_TIMEOUT_S, check=False)


def _git_toplevel(root: Path) -> Path | None:
    if shutil.which("git") is None or not _may_be_in_repo(root):
        return None
    proc = _git(root, "rev-parse", "--show-toplevel")
    if proc.returncode != 0:
        return None
    toplevel = Path(os.fsdecode(proc.stdout.strip()))
    if toplevel != root.resolve() and _git(root, "check-ignore", "-q", ".").returncode == 0:
        # A directory its enclosing repository ignores (e.g. a sandbox's code copy under
        # .dsec/) is not part of that repository: bundle it as a plain directory.
        return None
    return toplevel


def _may_be_in_repo(root: Path) -> bool:
    """False when no directory from ``root`` up has a ``.git``: git (run without ``GIT_DIR``)
    would find no work tree there, so it is not started (a few ms a call, twice a snapshot)."""
    real = Path(os.path.realpath(root))
    return any(os.path.lexists(os.path.join(d, ".git")) for d in (real, *real.parents))


def _git_paths(root: Path) -> list[str]:
    proc = _git(root, "ls-files", "--cached", "--others", "--exclude-standard", "-z")
    if proc.returncode != 0:
        raise BundleError(f"{root}: git ls-files failed: {proc.stderr.decode(errors='replace')}")
    out: list[str] = []
    for raw in proc.stdout.split(b"\0"):
        if not raw:
            continue
        rel = os.fsdecode(raw).rstrip("/")
        if (root / rel).is_dir() and not (root / rel).is_symlink():
            # A submodule or a nested repository: bundle its files as that repo sees them.
            out.extend(f"{rel}/{sub}" for sub in _nested_paths(root / rel))
        else:
            out.append(rel)
    return out


def _nested_paths(directory: Path) -> list[str]:
    if _git_toplevel(directory) == directory.resolve():
        return _git_paths(directory)
    return _walk_paths(directory, _exclude_spec(()))


def _stdout_or_none(proc: subprocess.CompletedProcess[bytes]) -> str | None:
    text = proc.stdout.decode(errors="replace").strip()
    return text if proc.returncode == 0 and text else None


def _filter_neutralizers(root: Path) -> list[str]:
    """``-c`` flags that disable every clean/process filter the repository config defines."""
    proc = _git(root, "config", "--get-regexp", r"^filter\..*\.(clean|process)$")
    flags: list[str] = []
    for line in proc.stdout.decode(errors="replace").splitlines():
        key = line.split(" ", 1)[0]
        flags += ["-c", f"{key}="]
    return flags


def git_info(root: Path) -> GitInfo | None:
    """Return the git state of ``root``, or ``None`` when it is not in a git work tree.

    Git is run so that the repository's own config cannot execute programs (fsmonitor, filter
    drivers): the tree may have been written by an untrusted agent.
    """
    root = Path(root).absolute()
    if _git_toplevel(root) is None:
        return None
    head = _git(root, "rev-parse", "--verify", "-q", "HEAD")
    branch = _git(root, "symbolic-ref", "-q", "--short", "HEAD")
    prefix = _git(root, "rev-parse", "--show-prefix")
    status = _git(
        root,
        "status", "--porcelain", "-z", "--untracked-files=normal", "--ignore-submodules=dirty",
        "--", ".",
        config=_filter_neutralizers(root),
    )  # fmt: skip
    return GitInfo(
        commit=_stdout_or_none(head),
        branch=_stdout_or_none(branch),
        path=prefix.stdout.decode().strip().rstrip("/"),
        dirty=status.returncode != 0 or bool(status.stdout.strip()),
    )


# --- hashing and manifests ------------------------------------------------------------------


def hash_file(path: Path) -> str:
    """Return the BLAKE3 hex of a regular file's content (never following a final symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        hasher = blake3.blake3()
        while block := fh.read(_READ_BLOCK):
            hasher.update(block)
    return hasher.hexdigest()


def _entry_hash(entry: TreeEntry) -> str:
    if entry.kind == "symlink":
        assert entry.target is not None
        return blake3.blake3(os.fsencode(entry.target)).hexdigest()
    return hash_file(entry.abspath)


def file_entry(entry: TreeEntry, digest: str, size: int | None = None) -> FileEntry:
    """Return the manifest row of ``entry`` given its content hash."""
    return FileEntry(
        entry.path,
        entry.kind,
        entry.size if size is None else size,
        entry.mode,
        digest,
        entry.target,
    )


def scan_tree(root: Path, exclude_patterns: Sequence[str] = ()) -> CodeManifest:
    """Return the code manifest of ``root`` (hashing every file) without building an archive.

    Raises:
        BundleError: ``root`` is not a directory, or a pattern is malformed.
    """
    entries = list_tree(root, exclude_patterns)
    check_names(entries)
    files = tuple(file_entry(e, _entry_hash(e)) for e in entries)
    return CodeManifest(files=files, git=git_info(root), exclude_patterns=tuple(exclude_patterns))


# --- archives -------------------------------------------------------------------------------


class _HashingWriter(io.RawIOBase):
    """Writes through to ``sink`` while hashing and counting the bytes."""

    def __init__(self, sink: IO[bytes]) -> None:
        self._sink = sink
        self.hasher = blake3.blake3()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.hasher.update(data)
        self.size += len(data)
        self._sink.write(data)
        return len(data)


class _HashingReader(io.RawIOBase):
    """Reads from ``source`` while hashing, for adding a file to a tar in one pass."""

    def __init__(self, source: BinaryIO) -> None:
        self._source = source
        self.hasher = blake3.blake3()

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._source.read(n)
        self.hasher.update(data)
        return data


def _tarinfo(entry: TreeEntry, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.path)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = entry.mode
    if entry.kind == "symlink":
        info.type = tarfile.SYMTYPE
        info.linkname = entry.target or ""
    else:
        info.size = size
    return info


def _add_entry(tar: tarfile.TarFile, entry: TreeEntry) -> FileEntry:
    if entry.kind == "symlink":
        tar.addfile(_tarinfo(entry, 0))
        return file_entry(entry, _entry_hash(entry))
    fd = os.open(entry.abspath, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        reader = _HashingReader(fh)
        try:
            tar.addfile(_tarinfo(entry, size), reader)
        except OSError as exc:
            raise BundleError(f"{entry.path}: changed while bundling ({exc})") from exc
        return file_entry(entry, reader.hasher.hexdigest(), size)


def _write_archive(
    entries: list[TreeEntry], sink: IO[bytes]
) -> tuple[tuple[FileEntry, ...], str, int]:
    hashing = _HashingWriter(sink)
    compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True)
    with (
        compressor.stream_writer(cast(IO[bytes], hashing), closefd=False) as zstd_out,
        tarfile.open(fileobj=zstd_out, mode="w|", format=tarfile.PAX_FORMAT) as tar,
    ):
        files = tuple(_add_entry(tar, e) for e in entries)
    return files, hashing.hasher.hexdigest(), hashing.size


def declared_max_size(spec_yaml: str) -> int:
    """The spec's ``include_code.max_size`` (at most :data:`MAX_SIZE_LIMIT`), or
    :data:`DEFAULT_MAX_SIZE` when unset or unreadable: what a bundle is read with before the
    spec is validated (validation then reports a bad value, located)."""
    import yaml

    from dsec_core.spec.units import parse_size

    try:
        include = yaml.safe_load(spec_yaml).get("include_code", {})
        return min(parse_size(include["max_size"]), MAX_SIZE_LIMIT)
    except (yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError):
        return DEFAULT_MAX_SIZE


def check_size(entries: Sequence[TreeEntry], max_size: int) -> None:
    """Refuse a tree whose files add up to more than ``max_size``, naming the largest files.

    Sizes are the files' apparent sizes: a sparse file counts what it would occupy once
    extracted, however well it compresses.

    Raises:
        BundleError: over the bound.
    """
    total = sum(e.size for e in entries)
    if total <= max_size:
        return
    largest = sorted(entries, key=lambda e: e.size, reverse=True)[:_LARGEST_SHOWN]
    shown = ", ".join(f"{e.path} ({_human(e.size)})" for e in largest)
    raise BundleError(
        f"the code is {_human(total)} once extracted, over include_code.max_size "
        f"{_human(max_size)}; largest files: {shown} (exclude them with "
        "include_code.exclude_patterns, or raise include_code.max_size)"
    )


def _human(size: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor:
            return f"{size / factor:.1f} {unit}"
    return f"{size} B"


def _check_shape(entries: Sequence[TreeEntry]) -> None:
    """What every reader refuses is refused where the bundle is built, before any upload:
    paths past :data:`MAX_PATH_BYTES` or :data:`MAX_DEPTH`, more than :data:`MAX_MEMBERS`
    files and directories."""
    dirs: set[str] = set()
    for entry in entries:
        path = _safe_member_path(entry.path)
        dirs.update(str(parent) for parent in path.parents[:-1])
    if len(entries) + len(dirs) > MAX_MEMBERS:
        raise BundleError(
            f"{len(entries)} files and {len(dirs)} directories, more than the {MAX_MEMBERS} "
            "entries a bundle may hold; exclude some (include_code.exclude_patterns)"
        )


def build_bundle(
    root: Path,
    exclude_patterns: Sequence[str] = (),
    *,
    out: Path | None = None,
    max_size: int | None = None,
) -> Bundle:
    """Bundle ``root``: the manifest plus a deterministic ``tar.zst`` archive.

    Args:
        root: Directory to bundle.
        exclude_patterns: Extra gitignore-style patterns (the spec's ``exclude_patterns``).
        out: Write the archive to this file (atomically); by default it is kept in memory.
        max_size: Refuse a tree whose files add up to more than this (checked before any file
            is read); ``None``: no bound.

    Returns:
        The bundle; ``digest`` is the BLAKE3 hex of the archive bytes.

    Raises:
        BundleError: ``root`` is not a directory, a pattern is malformed, the tree is larger
            than ``max_size``, or a file changed while it was read.
    """
    root = Path(root).absolute()
    skipped: list[str] = []
    entries = list_tree(root, exclude_patterns, skipped=skipped)
    check_names(entries)
    _check_shape(entries)
    if max_size is not None:
        check_size(entries, max_size)
    git = git_info(root)
    if out is None:
        buffer = io.BytesIO()
        files, digest, size = _write_archive(entries, buffer)
        data: bytes | None = buffer.getvalue()
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".bundle-", delete=False) as tmp:
            try:
                files, digest, size = _write_archive(entries, tmp)
            except BaseException:
                os.unlink(tmp.name)
                raise
        os.replace(tmp.name, out)
        data = None
    if max_size is not None and size > archive_bound(max_size):
        if out is not None:
            out.unlink(missing_ok=True)
        raise BundleError(
            f"its archive is {_human(size)}, more than the {_human(archive_bound(max_size))} a "
            f"bundle under include_code.max_size {_human(max_size)} may take; raise max_size or "
            "exclude files (include_code.exclude_patterns)"
        )
    manifest = CodeManifest(files=files, git=git, exclude_patterns=tuple(exclude_patterns))
    return Bundle(
        manifest=manifest, digest=digest, size=size, data=data, path=out, skipped=tuple(skipped)
    )


# --- extraction -----------------------------------------------------------------------------


MAX_PATH_BYTES = 4096
"""The longest member path (or symlink target) an archive may hold: Linux's PATH_MAX."""
MAX_DEPTH = 128
"""The deepest member path: removing a tree deeper than Python's recursion allows failed, and
every parent of a member is held while it is checked."""
MAX_HEADER_BYTES = 64 * 1024
"""The largest extended (PAX or GNU long-name) header: tarfile reads one whole before the
member it describes, outside any other bound (a 33 KB archive held 4 GB)."""
MAX_HEADERS_IN_A_ROW = 8
"""Extended headers before one member: tarfile recurses once for each."""
MAX_WINDOW = 8 * 2**20
"""The largest zstd window a bundle may declare (libzstd allows 128 MiB, held by each reader);
bundles are written at level 3, a 2 MiB window."""


def _safe_member_path(name: str) -> PurePosixPath:
    if len(name.encode(errors="surrogateescape")) > MAX_PATH_BYTES:
        raise BundleError(f"archive member {name[:80]!r}…: a path over {MAX_PATH_BYTES} bytes")
    path = PurePosixPath(name)
    if len(path.parts) > MAX_DEPTH:
        raise BundleError(f"archive member {name[:80]!r}…: deeper than {MAX_DEPTH} levels")
    if any(len(part.encode(errors="surrogateescape")) > 255 for part in path.parts):
        raise BundleError(f"archive member {name[:80]!r}…: a name over 255 bytes")
    if not name or "\0" in name or path.is_absolute() or ".." in path.parts:
        raise BundleError(f"archive member {name!r}: absolute or escaping path refused")
    if path.parts in ((), (".",)):
        raise BundleError(f"archive member {name!r}: empty path refused")
    return path


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How a directory of user content is opened: never through a symlink."""


def open_real_dir(
    root_fd: int, rel: PurePosixPath | str, *, create: bool = False, mode: int = 0o755
) -> int:
    """Open the directory ``rel`` below the directory ``root_fd``, never following a symlink.

    Each component is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the one above it
    (and created first with ``create``), so neither a symlink nor a rename racing the walk can
    lead outside ``root_fd``: what user content (a code bundle, a sandbox's files) put there is
    never followed by a privileged process.

    Returns:
        A new fd (close-on-exec) the caller closes.

    Raises:
        NotADirectoryError: naming the first component that is a symlink or not a directory.
        FileNotFoundError: a component is missing and ``create`` is false.
    """
    parts = PurePosixPath(rel).parts
    if any(p in ("..", "/") for p in parts):
        raise NotADirectoryError(f"{rel}: absolute or escaping path refused")
    fd = os.dup(root_fd)
    done = PurePosixPath()
    try:
        for part in parts:
            done /= part
            child = open_child_dir(fd, part, done, create=create, mode=mode)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_child_dir(
    dir_fd: int, name: str, shown: object, *, create: bool = False, mode: int = 0o755
) -> int:
    """Open the directory ``name`` in the directory ``dir_fd`` (created first with
    ``create``) with ``O_NOFOLLOW | O_DIRECTORY``: one step of :func:`open_real_dir`.

    Raises:
        NotADirectoryError: naming ``shown`` (the path so far) when it is a symlink or not a
            directory.
    """
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, mode, dir_fd=dir_fd)
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotADirectoryError(
                f"{shown} is a symlink or not a directory; refusing to follow it"
            ) from None
        raise


def _key(path: PurePosixPath) -> bytes:
    """What a member's path is remembered by while an archive is read: 16 bytes of its BLAKE3,
    not the path (100,000 members of 4 KB names held 400 MB)."""
    return blake3.blake3(str(path).encode(errors="surrogateescape")).digest(16)


class _Budget:
    """What an archive may create: ``max_members`` entries, ``max_size`` bytes of files
    (counted as they are read, whatever the headers claim)."""

    def __init__(self, max_size: int, max_members: int) -> None:
        self.max_size = max_size
        self.max_members = max_members
        self.size = 0
        self.members = 0
        self.dirs: set[bytes] = set()
        """Directories the archive made so far, named or implied by a deeper member's path."""

    def enter(self, member: tarfile.TarInfo) -> PurePosixPath:
        """The member's checked path, counted as an entry with each directory it implies: an
        archive of 2,000 members 50 levels deep made 100,000 directories while the count said
        2,000. Every member counts, a directory named again too (a million of them cost a
        minute of a shared scan thread, uncounted)."""
        rel = _safe_member_path(member.name)
        if member.issym() and len(member.linkname.encode(errors="surrogateescape")) > (
            MAX_PATH_BYTES
        ):
            raise BundleError(f"archive member {member.name!r}: a link over {MAX_PATH_BYTES} bytes")
        if member.linkname and (member.isreg() or member.isdir()):
            raise BundleError(f"archive member {member.name!r}: a link name on a non-link")
        new: list[bytes] = []  # the parents not seen yet: a seen one's parents were seen too
        parent = rel.parent
        while parent.parts and (key := _key(parent)) not in self.dirs:
            new.append(key)
            parent = parent.parent
        for key in reversed(new):
            self.dirs.add(key)
            self.count_member(member.name)
        if member.isdir():
            self.dirs.add(_key(rel))  # counted again if named again: each member is work
        self.count_member(member.name)
        return rel

    def count_member(self, name: str) -> None:
        self.members += 1
        if self.members > self.max_members:
            raise BundleError(
                f"archive member {name!r}: more than {self.max_members} entries; refused"
            )

    def charge(self, name: str, size: int, *, claimed: bool = False) -> None:
        """Count ``size`` bytes (only check them when ``claimed``: a header's promise)."""
        if self.size + size > self.max_size:
            raise BundleError(
                f"archive member {name!r}: the bundle expands past include_code.max_size "
                f"{_human(self.max_size)}; extraction stopped"
            )
        if not claimed:
            self.size += size


class _Scan(_Budget):
    """Reads an archive's members without writing any, refusing what an extraction refuses
    (escaping or duplicate paths, a member below a file or symlink, special files, the
    bounds)."""

    def __init__(self, max_size: int, max_members: int) -> None:
        super().__init__(max_size, max_members)
        self.kinds: dict[bytes, str] = {}  # by :func:`_key`
        self._checked: set[bytes] = set()  # directories whose parents were checked

    def place(self, member: tarfile.TarInfo) -> PurePosixPath:
        rel = self.enter(member)
        parent = rel.parent  # up to the nearest one checked: its own parents were too
        while parent.parts and (key := _key(parent)) not in self._checked:
            if self.kinds.setdefault(key, "dir") != "dir":
                raise BundleError(
                    f"archive member {rel}: parent {parent} is a symlink or not a directory; "
                    "refusing to follow it"
                )
            self._checked.add(key)
            parent = parent.parent
        if not (member.isdir() or member.isreg() or member.issym()):
            raise BundleError(
                f"archive member {member.name!r}: only files and symlinks are allowed"
            )
        kind = "dir" if member.isdir() else "link" if member.issym() else "file"
        before = self.kinds.get(key := _key(rel))
        if before is not None and (before != "dir" or kind != "dir"):
            raise BundleError(f"archive member {member.name!r}: duplicate path")
        self.kinds[key] = kind
        return rel


def read_members(
    data: bytes | Path | BinaryIO,
    want: Callable[[PurePosixPath, tarfile.TarInfo], bool],
    *,
    max_size: int = DEFAULT_MAX_SIZE,
    max_members: int = MAX_MEMBERS,
    deadline_s: float | None = None,
) -> Iterator[tuple[PurePosixPath, bytes]]:
    """The regular files of a bundle archive that ``want(path, member)`` selects, with their
    bytes, read as the archive streams by: nothing is written, memory holds one selected file
    at a time. Every member is checked as :func:`extract_bundle` checks it, and every file's
    bytes are counted against ``max_size``, selected or not.

    ``deadline_s``: the reading ends (``BundleError``) past this many seconds of the thread's
    CPU time: a shared reader's threads must come back.

    Raises:
        BundleError: as :func:`extract_bundle`.
    """
    scan = _Scan(max_size, max_members)
    # the thread's own CPU time: another scan beside it (the GIL) must not make it run out
    until = None if deadline_s is None else time.thread_time() + deadline_s
    with _tar_stream(data) as tar:
        for member in tar:
            if until is not None and time.thread_time() > until:
                raise BundleError(f"reading the bundle took more than {deadline_s:.0f} s")
            rel = scan.place(member)
            if not member.isreg():
                continue
            scan.charge(member.name, member.size, claimed=True)
            source = tar.extractfile(member)
            assert source is not None
            chosen = want(rel, member)
            parts: list[bytes] = []
            while block := source.read(_READ_BLOCK):
                scan.charge(member.name, len(block))
                if chosen:
                    parts.append(block)
            if chosen:
                yield rel, b"".join(parts)


class _Extraction(_Budget):
    """Writes an archive's members below one directory fd, counting what it creates."""

    def __init__(self, root_fd: int, max_size: int, max_members: int) -> None:
        super().__init__(max_size, max_members)
        self.root_fd = root_fd
        self._parent: tuple[PurePosixPath, int] | None = None

    def close(self) -> None:
        if self._parent is not None:
            os.close(self._parent[1])
            self._parent = None

    def parent_fd(self, rel: PurePosixPath) -> int:
        """The fd of ``rel``'s parent (created), cached for the next member of the same dir."""
        parent = rel.parent
        if self._parent is not None and self._parent[0] == parent:
            return self._parent[1]
        try:
            fd = open_real_dir(self.root_fd, parent, create=True)
        except NotADirectoryError as exc:
            raise BundleError(f"archive member {rel}: parent {exc}") from None
        self.close()
        self._parent = (parent, fd)
        return fd

    def extract(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> str | None:
        rel = self.enter(member)
        if member.isdir():
            try:
                os.close(open_real_dir(self.root_fd, rel, create=True))
            except NotADirectoryError as exc:
                raise BundleError(f"archive member {rel}: {exc}") from None
            return None
        if not (member.isreg() or member.issym()):
            raise BundleError(
                f"archive member {member.name!r}: only files and symlinks are allowed"
            )
        parent = self.parent_fd(rel)
        try:
            if member.issym():
                os.symlink(member.linkname, rel.name, dir_fd=parent)
                return str(rel)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(rel.name, flags, member.mode & 0o777, dir_fd=parent)
        except FileExistsError as exc:
            raise BundleError(f"archive member {member.name!r}: duplicate path") from exc
        except OSError as exc:  # a name the file system refuses: the bundle's fault
            raise BundleError(f"archive member {member.name[:80]!r}: {exc.strerror}") from exc
        self.charge(member.name, member.size, claimed=True)  # before writing anything
        source = tar.extractfile(member)
        assert source is not None
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), member.mode & 0o777)  # exact mode, whatever the umask
            while block := source.read(_READ_BLOCK):
                self.charge(member.name, len(block))  # what is really written
                fh.write(block)
        return str(rel)


@contextlib.contextmanager
def _open_archive(data: bytes | Path | BinaryIO) -> Iterator[BinaryIO]:
    if isinstance(data, bytes):
        yield io.BytesIO(data)
    elif isinstance(data, Path):
        with data.open("rb") as fh:
            yield fh
    else:
        yield data


class _BoundedTarInfo(tarfile.TarInfo):
    """Members as tarfile reads them, with what it reads before any caller's check bounded:
    extended headers at most :data:`MAX_HEADER_BYTES` each and :data:`MAX_HEADERS_IN_A_ROW`
    before a member; no sparse members (their maps expanded a 5.8 KB archive to 3 GB) and no
    global headers. A bundle built by :func:`build_bundle` never holds any of these."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in (tarfile.GNUTYPE_SPARSE, tarfile.XGLTYPE):
            raise tarfile.HeaderError("sparse members and global headers are refused")
        if self.type not in (*tarfile.GNU_TYPES, tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
            return super()._proc_member(tarfile_)  # type: ignore[misc, no-any-return]
        if self.size > MAX_HEADER_BYTES:
            raise tarfile.HeaderError(
                f"an extended header of {self.size} bytes, over {MAX_HEADER_BYTES}"
            )
        depth = getattr(tarfile_, "_dsec_headers", 0) + 1
        if depth > MAX_HEADERS_IN_A_ROW:
            raise tarfile.HeaderError(f"more than {MAX_HEADERS_IN_A_ROW} extended headers in a row")
        tarfile_._dsec_headers = depth  # type: ignore[attr-defined]
        try:
            return super()._proc_member(tarfile_)  # type: ignore[misc, no-any-return]
        finally:
            tarfile_._dsec_headers = depth - 1  # type: ignore[attr-defined]

    def _refuse_sparse(self, *_: object) -> None:
        raise tarfile.HeaderError("sparse members are refused")

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse

    def _proc_pax(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        """An extended header, parsed strictly and in one pass: at most
        :data:`MAX_PAX_RECORDS` records, each once, of the fields a bundle's members use.
        tarfile's own parser took any field (9,000 of them per header cost 17 ms and a dict
        each) and searched ``hdrcharset`` with a regex quadratic before Python 3.11.10."""
        data = tarfile_.fileobj.read(self._block(self.size))[: self.size]  # type: ignore[attr-defined]
        pax = _pax_records(data)
        try:
            following = self.fromtarfile(tarfile_)
        except tarfile.HeaderError as exc:
            raise tarfile.HeaderError(f"after an extended header: {exc}") from None
        following._apply_pax_info(pax, tarfile_.encoding, tarfile_.errors)  # type: ignore[attr-defined]
        following.offset = self.offset
        if "size" in pax:  # the header's size replaces the member's: where the next one starts
            offset = following.offset_data
            if following.isreg() or following.type not in tarfile.SUPPORTED_TYPES:
                offset += following._block(following.size)  # type: ignore[attr-defined]
            tarfile_.offset = offset
        return following


PAX_FIELDS = frozenset(
    {"path", "linkpath", "size", "mtime", "atime", "ctime", "uid", "gid", "uname", "gname"}
)
"""The extended-header fields a bundle member may carry (what tarfile writes for a long or
non-ASCII name, a large size or a fractional time)."""
MAX_PAX_RECORDS = len(PAX_FIELDS)


def _pax_records(data: bytes) -> dict[str, str]:
    """The records ``LEN KEY=VALUE\\n`` of an extended header: UTF-8, known fields, each once."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 8)
        digits = data[pos:space] if space > pos else b""
        if not digits.isdigit():
            raise tarfile.HeaderError("a malformed extended header")
        end = pos + int(digits)
        if end > len(data) or end <= space + 1 or data[end - 1 : end] != b"\n":
            raise tarfile.HeaderError("a malformed extended header record")
        key, sep, value = data[space + 1 : end - 1].partition(b"=")
        try:
            field, text = key.decode(), value.decode()
        except UnicodeDecodeError:
            raise tarfile.HeaderError("an extended header that is not UTF-8") from None
        if not sep or field not in PAX_FIELDS or field in records:
            raise tarfile.HeaderError(f"extended header field {field[:40]!r} refused")
        records[field] = text
        pos = end
    if len(records) > MAX_PAX_RECORDS:
        raise tarfile.HeaderError("too many extended header records")
    return records


class _Forget(list):  # type: ignore[type-arg]
    """``TarFile.members`` that keeps nothing: a stream is read once, and tarfile kept every
    member it read, extended headers and all (2,000 of them, 1.5 GB)."""

    def append(self, _: object) -> None:
        pass


@contextlib.contextmanager
def _tar_stream(data: bytes | Path | BinaryIO) -> Iterator[tarfile.TarFile]:
    """The archive's tar stream, decompressed as it is read (members in order, once), its
    headers bounded (:class:`_BoundedTarInfo`); a broken archive is a :class:`BundleError`,
    whatever tarfile raised for it (some broken headers raise ``ValueError`` or
    ``RecursionError``). A :class:`BundleError` of the caller's passes unchanged."""
    try:
        with (
            _open_archive(data) as raw,
            zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(raw) as plain,
            tarfile.open(fileobj=plain, mode="r|", tarinfo=_BoundedTarInfo) as tar,
        ):
            tar.members = _Forget()  # type: ignore[attr-defined]
            yield tar
    except BundleError:
        raise
    except (
        tarfile.TarError, zstandard.ZstdError, ValueError, RecursionError, EOFError,
        UnicodeError, OverflowError,
    ) as exc:  # fmt: skip
        raise BundleError(f"not a valid bundle archive: {type(exc).__name__}: {exc}") from exc


def extract_bundle(
    data: bytes | Path | BinaryIO,
    dest: Path,
    *,
    max_size: int = DEFAULT_MAX_SIZE,
    max_members: int = MAX_MEMBERS,
) -> list[str]:
    """Extract a bundle archive into ``dest`` (which must not exist or be empty).

    The archive is unpacked into a sibling temporary directory first and moved into place only
    when every member was valid, so a refused archive leaves nothing behind.

    Args:
        data: The archive as bytes, a path, or a binary stream.
        dest: Directory to create.
        max_size: Bytes the files may add up to once extracted (counted as written).
        max_members: Entries the archive may create.

    Returns:
        The paths written (files and symlinks), in archive order.

    Raises:
        BundleError: ``dest`` is not empty, or a member is absolute, escapes ``dest``, is a
            special file or hard link, is duplicated, or would be written through a symlink;
            or the archive expands past ``max_size`` or ``max_members``.
    """
    dest = Path(dest).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BundleError(f"{dest}: destination exists and is not an empty directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.extract-"))
    try:
        written = _extract_all(data, staging, max_size, max_members)
        staging.chmod(0o755)  # mkdtemp made it private
        if dest.exists():
            dest.rmdir()
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written


def _extract_all(
    data: bytes | Path | BinaryIO, staging: Path, max_size: int, max_members: int
) -> list[str]:
    written: list[str] = []
    root_fd = os.open(staging, DIR_FLAGS)
    extraction = _Extraction(root_fd, max_size, max_members)
    try:
        with _tar_stream(data) as tar:
            for member in tar:
                rel = extraction.extract(tar, member)
                if rel is not None:
                    written.append(rel)
    finally:
        extraction.close()
        os.close(root_fd)
    return written
