"""Read an agent's code directory into the mapping the pure analysis takes."""

from __future__ import annotations

import os
import tempfile
from fnmatch import fnmatch
from pathlib import Path
from typing import BinaryIO

from dsec_core.codebundle import DEFAULT_MAX_SIZE, BundleError, extract_bundle

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
MAX_FILES = 10_000


class CodeDirError(ValueError):
    """The code directory cannot be read (missing, not a directory, too large)."""


def read_python_sources(root: Path, exclude_patterns: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every ``*.py`` file under ``root`` as ``{relative/posix/path: bytes}``.

    Virtual environments, caches and VCS folders are skipped, as are files matching
    ``exclude_patterns`` (the spec's ``include_code.exclude_patterns``) and files over 2 MiB.
    Symlinks are not followed, so nothing outside ``root`` is read.

    Raises:
        CodeDirError: ``root`` is not a directory or holds more than 10,000 Python files.
    """
    if not root.is_dir():
        raise CodeDirError(f"{root}: not a directory")
    out: dict[str, bytes] = {}
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
            if len(out) > MAX_FILES:
                raise CodeDirError(f"{root}: more than {MAX_FILES} Python files")
    return out


def read_bundle_sources(
    archive: bytes | Path | BinaryIO, max_size: int = DEFAULT_MAX_SIZE
) -> dict[str, bytes]:
    """The ``*.py`` files of a code bundle archive (``dsec_core.codebundle``).

    The archive is extracted into a temporary directory that is always removed; it may expand
    to ``max_size`` bytes (the spec's ``include_code.max_size``).

    Raises:
        CodeDirError: the archive is not a valid bundle.
    """
    with tempfile.TemporaryDirectory(prefix="dsec-policy-") as tmp:
        try:
            extract_bundle(archive, Path(tmp) / "code", max_size=max_size)
        except BundleError as exc:
            raise CodeDirError(f"invalid code bundle: {exc}") from None
        return read_python_sources(Path(tmp) / "code")
