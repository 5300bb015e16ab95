"""Environment archives: how a built environment travels from the builder to every node.

The builder packs the environment of one lock (``site-packages/`` and ``env.json``) into a tar
stream compressed with zstd and stores it once for the whole cluster at
:func:`dsec_core.objectstore.env_archive_key`; ``env.built`` carries the archive's BLAKE3 digest,
its size and the bytes it unpacks to. A node agent downloads it, checks the digest, and unpacks
it with :func:`unpack` into a temporary directory beside its destination, renamed into place only
when every member was valid, so a corrupted or hostile archive leaves nothing half-unpacked.

Unpacking refuses absolute or ``..`` paths, special files and hard links, a link whose target is
absolute or leaves the environment, any write through a link (directories are opened with
``O_NOFOLLOW``, :func:`dsec_core.codebundle.open_real_dir`), more bytes than ``env.built``
announced (counted as written) and more than :data:`MAX_MEMBERS` entries.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, cast

import blake3
import zstandard

from dsec_core.codebundle import BundleError, _Extraction, _safe_member_path

__all__ = [
    "MAX_MEMBERS",
    "MAX_UNPACKED_BYTES",
    "EnvArchiveError",
    "Packed",
    "digest_file",
    "pack",
    "unpack",
]

MAX_UNPACKED_BYTES = 32 * 2**30
"""The most an environment may unpack to on a node (whatever ``env.built`` announces)."""
MAX_MEMBERS = 500_000
"""Files, links and directories one environment archive may create (an inode bound)."""
_ZSTD_LEVEL = 3
_BLOCK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class EnvArchiveError(ValueError):
    """An environment archive that cannot be packed or unpacked (the reason names the member)."""


@dataclass(frozen=True)
class Packed:
    """What :func:`pack` wrote."""

    digest: str
    """BLAKE3 of the archive bytes, hex."""
    size_bytes: int
    unpacked_bytes: int
    """Bytes of the regular files inside (what unpacking writes)."""
    members: int


class _Hashing:
    """A write-only file object that hashes and counts what passes through to ``sink``."""

    def __init__(self, sink: IO[bytes]) -> None:
        self._sink = sink
        self.hasher = blake3.blake3()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.hasher.update(data)
        self.size += len(data)
        self._sink.write(data)
        return len(data)

    def flush(self) -> None:
        self._sink.flush()


def _link_inside(rel: PurePosixPath, target: str) -> bool:
    """Whether a link at ``rel`` pointing to ``target`` stays inside the archive's root."""
    if not target or "\0" in target or target.startswith("/"):
        return False
    depth = len(rel.parent.parts)
    for part in PurePosixPath(target).parts:
        if part == "..":
            depth -= 1
            if depth < 0:
                return False
        elif part != ".":
            depth += 1
    return True


def _info(name: str, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = stat.S_IMODE(mode)
    return info


def _add(tar: tarfile.TarFile, root: Path, rel: PurePosixPath) -> int:
    """Add one entry; returns the regular-file bytes it adds."""
    path = root / rel
    st = os.lstat(path)
    info = _info(rel.as_posix(), st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        return 0
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        if not _link_inside(rel, target):
            raise EnvArchiveError(f"{rel}: link to {target!r} leaves the environment; refused")
        info.type, info.linkname = tarfile.SYMTYPE, target
        tar.addfile(info)
        return 0
    if not stat.S_ISREG(st.st_mode):
        raise EnvArchiveError(f"{rel}: not a file, directory or link; refused")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        info.size = os.fstat(fd).st_size
        tar.addfile(info, fh)
    return info.size


def _entries(root: Path) -> list[PurePosixPath]:
    """Every path below ``root`` in a stable order (directories before their contents)."""
    out: list[PurePosixPath] = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        here = PurePosixPath(Path(directory).relative_to(root).as_posix())
        for name in sorted(dirs):
            if os.path.islink(os.path.join(directory, name)):
                files.append(name)  # a link to a directory is packed as a link
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(directory, d))]
        out += [here / d for d in dirs]
        out += [here / f for f in sorted(files)]
    return out


def pack(root: Path, dest: Path) -> Packed:
    """Pack the tree at ``root`` into ``dest`` (tar, zstd; fixed owners and times).

    Raises:
        EnvArchiveError: the tree holds a special file or a link leaving it.
    """
    entries = _entries(root)
    unpacked = 0
    with dest.open("wb") as sink:
        hashing = _Hashing(sink)
        compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True, threads=-1)
        with (
            compressor.stream_writer(cast(IO[bytes], hashing), closefd=False) as zstd_out,
            tarfile.open(fileobj=zstd_out, mode="w|", format=tarfile.PAX_FORMAT) as tar,
        ):
            for rel in entries:
                unpacked += _add(tar, root, rel)
    return Packed(hashing.hasher.hexdigest(), hashing.size, unpacked, len(entries))


def digest_file(path: Path) -> tuple[str, int]:
    """BLAKE3 (hex) and size of a file."""
    hasher = blake3.blake3()
    size = 0
    with path.open("rb") as fh:
        while block := fh.read(_BLOCK):
            hasher.update(block)
            size += len(block)
    return hasher.hexdigest(), size


class _EnvExtraction(_Extraction):
    """The code bundle's extraction, with the environment's own bounds and link rule."""

    def charge(self, name: str, size: int, *, claimed: bool = False) -> None:
        if self.size + size > self.max_size:
            raise EnvArchiveError(
                f"archive member {name!r}: the environment unpacks past the {self.max_size} "
                "bytes its env.built announced; unpacking stopped"
            )
        if not claimed:
            self.size += size

    def extract(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> str | None:
        if member.issym() and not _link_inside(_safe_member_path(member.name), member.linkname):
            raise EnvArchiveError(
                f"archive member {member.name!r}: link to {member.linkname!r} leaves the "
                "environment; refused"
            )
        return super().extract(tar, member)


def unpack(archive: Path, dest: Path, *, max_bytes: int, max_members: int = MAX_MEMBERS) -> int:
    """Unpack ``archive`` into ``dest`` (which must not exist), atomically.

    The members go into a temporary directory beside ``dest``, renamed to ``dest`` only when all
    were valid; on any error the temporary directory is removed.

    Returns:
        The bytes written.

    Raises:
        EnvArchiveError: an unsafe or malformed member, or past ``max_bytes`` / ``max_members``.
        FileExistsError: ``dest`` exists.
    """
    if dest.exists():
        raise FileExistsError(f"{dest} exists")
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.unpack-"))
    try:
        written = _unpack_into(archive, staging, min(max_bytes, MAX_UNPACKED_BYTES), max_members)
        staging.chmod(0o755)  # mkdtemp made it private
        os.rename(staging, dest)
    except BaseException:
        remove_tree(staging)
        raise
    return written


def _unpack_into(archive: Path, staging: Path, max_bytes: int, max_members: int) -> int:
    root_fd = os.open(staging, _DIR_FLAGS)
    extraction = _EnvExtraction(root_fd, max_bytes, max_members)
    try:
        with (
            archive.open("rb") as raw,
            zstandard.ZstdDecompressor().stream_reader(raw) as plain,
            tarfile.open(fileobj=plain, mode="r|") as tar,
        ):
            for member in tar:
                extraction.extract(tar, member)
    except BundleError as exc:
        raise EnvArchiveError(str(exc)) from None
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise EnvArchiveError(f"not a valid environment archive: {exc}") from None
    finally:
        extraction.close()
        os.close(root_fd)
    return extraction.size


def remove_tree(root: Path) -> None:
    """Delete a tree, read-only parts included (never following links)."""
    if not root.exists() and not root.is_symlink():
        return
    for directory, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o755)
    shutil.rmtree(root, ignore_errors=True)
