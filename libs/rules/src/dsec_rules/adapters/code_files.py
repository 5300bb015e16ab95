"""Read an agent's code directory into the mapping the pure analysis takes."""

from __future__ import annotations

import os
import tarfile
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from dsec_core.codebundle import DEFAULT_MAX_SIZE, BundleError, read_members

SKIPPED_DIRS = frozenset(
    {
        ".git",
        "__pycache__",
        ".venv",
        "venv",
        "node_modules",
        ".tox",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        "site-packages",
        ".dsec",
    }
)
MAX_FILE_BYTES = 2 * 2**20
"""A Python file larger than this is not analyzed (generated code, data in a ``.py``)."""
MAX_FILES = 10_000
MAX_TOTAL_BYTES = 16 * 2**20
"""The Python sources analyzed at most, all files together: held in memory by the shared
policy service (several validations at once), whatever ``include_code.max_size`` a spec asks."""


class CodeDirError(ValueError):
    """The code directory cannot be read (missing, not a directory, too large)."""


def read_python_sources(root: Path, exclude_patterns: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every ``*.py`` file under ``root`` as ``{relative/posix/path: bytes}``.

    Virtual environments, caches and VCS folders are skipped, as are files matching
    ``exclude_patterns`` (the spec's ``include_code.exclude_patterns``) and files over 2 MiB.
    Symlinks are not followed, so nothing outside ``root`` is read.

    Raises:
        CodeDirError: ``root`` is not a directory or holds more than 10,000 Python files or
            16 MiB of them.
    """
    if not root.is_dir():
        raise CodeDirError(f"{root}: not a directory")
    out: dict[str, bytes] = {}
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if not name.endswith(".py") or path.is_symlink():
                continue
            if any(fnmatch(rel, pattern) for pattern in exclude_patterns):
                continue
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            out[rel] = path.read_bytes()
            total += len(out[rel])
            _check_bounds(len(out), total, str(root))
    return out


def _check_bounds(files: int, total: int, where: str) -> None:
    """Refuse more Python files, or more bytes of them, than one analysis takes."""
    if files > MAX_FILES:
        raise CodeDirError(f"{where}: more than {MAX_FILES} Python files")
    if total > MAX_TOTAL_BYTES:
        raise CodeDirError(
            f"{where}: more than {MAX_TOTAL_BYTES // 2**20} MiB of Python sources to analyze; "
            "exclude generated or vendored code (include_code.exclude_patterns)"
        )


SCAN_DEADLINE_S = 60.0
"""How long reading one bundle's sources may take (the policy service's scan threads are
shared by every tenant)."""


def read_bundle_sources(
    archive: bytes | Path | BinaryIO,
    max_size: int = DEFAULT_MAX_SIZE,
    deadline_s: float | None = SCAN_DEADLINE_S,
) -> dict[str, bytes]:
    """The ``*.py`` files of a code bundle archive (``dsec_core.codebundle``), chosen as
    :func:`read_python_sources` chooses them, read as the archive streams by: nothing is
    written to disk, and memory holds the sources (at most ``MAX_TOTAL_BYTES``), not the
    bundle. Every member is checked as an extraction checks it, within ``max_size`` (the
    spec's ``include_code.max_size``).

    Raises:
        CodeDirError: the archive is not a valid bundle, or holds more Python than one
            analysis takes.
    """
    out: dict[str, bytes] = {}
    total = 0

    def wanted(rel: PurePosixPath, member: tarfile.TarInfo) -> bool:
        return (
            rel.name.endswith(".py")
            and not any(part in SKIPPED_DIRS for part in rel.parts[:-1])
            and member.size <= MAX_FILE_BYTES
        )

    try:
        for rel, data in read_members(archive, wanted, max_size=max_size, deadline_s=deadline_s):
            out[rel.as_posix()] = data
            total += len(data)
            _check_bounds(len(out), total, "code bundle")
    except BundleError as exc:
        raise CodeDirError(f"invalid code bundle: {exc}") from None
    return dict(sorted(out.items()))
