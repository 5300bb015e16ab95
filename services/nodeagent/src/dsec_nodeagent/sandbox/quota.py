"""A disk quota for a sandbox's writable directories: a loop-mounted ext4 image of its own.

The host's filesystem (ext4 mounted without ``prjquota`` here; often the root filesystem) offers
no per-directory quota, and a tmpfs would put the outputs in memory and lose them at exit. So each
sandbox with writable directories gets a sparse image file ``DSEC_HOME/sandboxes/<id>/disk.img``
of ``resources.disk`` bytes, formatted ext4 (no journal, no reserved blocks, lazy inode tables:
~7 ms) and loop-mounted (``nosuid,nodev``; ~8 ms) at ``DSEC_HOME/sandboxes/<id>/fs``, where the
writable directories are created. A write beyond the quota fails with ``ENOSPC`` inside the
sandbox; the host's disk never sees more than the image's used blocks.

At exit the node agent notes whether the quota was full (``sandbox.exited{reason: "disk"}``),
copies the outputs out to a plain directory at the same path (so they stay readable where they
always were, bounded by the quota), unmounts the image and deletes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

IMAGE_NAME = "disk.img"
MOUNT_NAME = "fs"
FULL_MARGIN_BYTES = 2 * 2**20
"""Free space below ``max(this, 1 % of the quota)`` (or no free inode) at exit means the quota
was hit: ext4's delayed allocation refuses a write that, with its metadata, would not fit, so
``ENOSPC`` comes while up to about a write's size (and ext4's own reserve) still shows free."""


class QuotaError(RuntimeError):
    """The quota filesystem could not be made (names the tool and its error)."""


def _run(argv: list[str]) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, timeout=60)
    except FileNotFoundError as exc:
        raise QuotaError(f"{argv[0]} is not installed (e2fsprogs / util-linux)") from exc
    except subprocess.CalledProcessError as exc:
        why = exc.stderr.decode(errors="replace").strip().splitlines()
        raise QuotaError(f"{' '.join(argv[:2])} failed: {why[-1] if why else exc}") from exc


def mount_point(data_dir: Path) -> Path:
    """Where the sandbox's quota filesystem is (and its outputs stay after exit)."""
    return data_dir / MOUNT_NAME


def create(data_dir: Path, size_bytes: int) -> Path:
    """Make and mount the sandbox's quota filesystem; return its mount point.

    Raises:
        QuotaError: mkfs or mount failed (nothing is left mounted).
    """
    image, target = data_dir / IMAGE_NAME, mount_point(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    target.mkdir(exist_ok=True)
    with open(image, "wb") as fh:
        fh.truncate(size_bytes)
    os.chmod(image, 0o600)
    _run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-O",
            "^has_journal",
            "-m",
            "0",
            "-E",
            "lazy_itable_init=1,nodiscard,root_owner=0:0",
            str(image),
        ]
    )
    _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(target)])
    (target / "lost+found").rmdir()
    return target


def is_mounted(data_dir: Path) -> bool:
    """Whether the quota filesystem of this sandbox is mounted."""
    return os.path.ismount(mount_point(data_dir))


def full(data_dir: Path) -> str | None:
    """A sentence naming the full quota and its directories, or ``None`` when it was not hit."""
    target = mount_point(data_dir)
    if not os.path.ismount(target):
        return None
    st = os.statvfs(target)
    free = st.f_bavail * st.f_frsize
    size = (data_dir / IMAGE_NAME).stat().st_size
    margin = max(FULL_MARGIN_BYTES, size // 100)
    if free >= margin and st.f_favail > 0:
        return None
    paths = ", ".join("/" + p.name.replace("__", "/") for p in sorted(target.iterdir())) or "-"
    what = "space" if free < margin else "inodes"
    return (
        f"disk quota full: the writable directories ({paths}) ran out of {what} at "
        f"resources.disk = {_human(size)}; writes beyond it failed with ENOSPC"
    )


def release(data_dir: Path, *, keep_outputs: bool = True) -> None:
    """Copy the outputs out (unless ``keep_outputs`` is false), unmount, delete the image.

    Idempotent: a node agent that died halfway finishes the job at its next start.
    """
    target, image = mount_point(data_dir), data_dir / IMAGE_NAME
    saved = data_dir / f".{MOUNT_NAME}.saved"
    if os.path.ismount(target):
        if keep_outputs:
            shutil.rmtree(saved, ignore_errors=True)
            saved.mkdir()
            _run(["cp", "-a", "--sparse=always", f"{target}/.", str(saved)])
        try:
            _run(["umount", str(target)])
        except QuotaError:
            _run(["umount", "-l", str(target)])  # still busy: detach, freed when unused
        if keep_outputs:
            target.rmdir()
            saved.rename(target)
    elif saved.is_dir():  # died between the copy and the rename
        shutil.rmtree(target, ignore_errors=True)
        saved.rename(target)
    with contextlib.suppress(FileNotFoundError):
        image.unlink()


def _human(n: int) -> str:
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.4g} {unit}"
