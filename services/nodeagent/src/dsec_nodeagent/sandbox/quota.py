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
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import uuid
from pathlib import Path

from dsec_nodeagent.sandbox import syscalls

IMAGE_NAME = "disk.img"
MOUNT_NAME = "fs"
FULL_MARGIN_BYTES = 2 * 2**20
"""Free space below ``max(this, 1 % of the quota)`` (or no free inode) at exit means the quota
was hit: ext4's delayed allocation refuses a write that, with its metadata, would not fit, so
``ENOSPC`` comes while up to about a write's size (and ext4's own reserve) still shows free."""


MOUNT_OPTIONS = "noinit_itable"
"""The kernel must not zero the lazily initialized inode tables in the background: on a sparse
image that would write (and allocate) them on the host's disk for nothing."""
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
_LOOP_INFO64 = "=QQQQQIIII64s64s32sQQ"  # struct loop_info64 (232 bytes)


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


def format_image(image: Path, size_bytes: int) -> None:
    """A sparse ext4 image: no journal, no reserved blocks, lazy inode tables (~7 ms)."""
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


def create(data_dir: Path, size_bytes: int, pool: ImagePool | None = None) -> Path:
    """Make (or take from ``pool``) and mount the sandbox's quota filesystem; return its mount
    point.

    Raises:
        QuotaError: mkfs or mount failed (nothing is left mounted).
    """
    image, target = data_dir / IMAGE_NAME, mount_point(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    previous = data_dir / f".{MOUNT_NAME}.previous"
    # The outputs an earlier attempt of this sandbox left (a stateful sandbox started again in
    # place): moved aside, then copied into the new filesystem, never hidden under it.
    if not previous.exists() and target.is_dir() and not os.path.ismount(target):
        with contextlib.suppress(OSError):  # empty: nothing to carry over
            target.rmdir()
        if target.exists():
            target.rename(previous)
    target.mkdir(exist_ok=True)
    if pool is None or not pool.take(size_bytes, image):
        format_image(image, size_bytes)
    mount_image(image, target)
    with contextlib.suppress(FileNotFoundError):
        (target / "lost+found").rmdir()
    if previous.is_dir():
        try:
            _run(["cp", "-a", "--sparse=always", f"{previous}/.", str(target)])
        except QuotaError:
            with contextlib.suppress(OSError):
                syscalls.umount2(str(target), syscalls.MNT_DETACH)
            raise
        shutil.rmtree(previous, ignore_errors=True)
    return target


def mount_image(image: Path, target: Path) -> None:
    """Attach ``image`` to a free loop device (auto-cleared when unmounted) and mount it
    ``nosuid,nodev`` — with ioctls and mount(2), ~1 ms; mount(8) when the kernel lacks
    ``LOOP_CONFIGURE`` (before 5.8)."""
    try:
        _mount_loop(image, target)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTTY):
            raise QuotaError(f"cannot loop-mount {image}: {exc}") from exc
        _run(["mount", "-o", f"loop,nosuid,nodev,{MOUNT_OPTIONS}", str(image), str(target)])


def _mount_loop(image: Path, target: Path) -> None:
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(16):  # another process may take the free device first
                number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
                device = f"/dev/loop{number}"
                loop = os.open(device, os.O_RDWR | os.O_CLOEXEC)
                try:
                    info = struct.pack(
                        _LOOP_INFO64,
                        0,
                        0,
                        0,
                        0,
                        0,
                        0,
                        0,
                        0,
                        LO_FLAGS_AUTOCLEAR,
                        b"",
                        b"",
                        b"",
                        0,
                        0,
                    )
                    config = struct.pack("=II", backing, 0) + info + bytes(64)
                    try:
                        fcntl.ioctl(loop, LOOP_CONFIGURE, config)
                    except OSError as exc:
                        if exc.errno == errno.EBUSY:
                            continue
                        raise
                    # Mount before closing the device: auto-clear acts on its last close.
                    syscalls.mount(
                        device,
                        str(target),
                        "ext4",
                        syscalls.MS_NOSUID | syscalls.MS_NODEV,
                        MOUNT_OPTIONS,
                    )
                    return
                finally:
                    os.close(loop)
            raise OSError(errno.EBUSY, "no free loop device")
        finally:
            os.close(control)
    finally:
        os.close(backing)


class ImagePool:
    """Formatted, unused images of the sizes recently asked for, so that mkfs is not on a
    sandbox's start path; kept under ``DSEC_HOME/cache/disk-images`` (the data directories'
    filesystem: taking one is a rename)."""

    def __init__(self, directory: Path, per_size: int = 2) -> None:
        self.directory = directory
        self.per_size = per_size

    def _ready(self, size_bytes: int) -> list[Path]:
        return sorted(self.directory.glob(f"{size_bytes}-*.img"))

    def take(self, size_bytes: int, dest: Path) -> bool:
        """Move a formatted image of ``size_bytes`` to ``dest``; ``False`` when none is ready."""
        try:
            ready = self._ready(size_bytes)
        except OSError:
            return False
        for image in ready:
            try:
                os.rename(image, dest)
            except FileNotFoundError:  # taken by a concurrent start
                continue
            except OSError:  # another filesystem than the data directories (EXDEV): format
                return False
            return True
        return False

    def prune(self, keep_sizes: set[int]) -> None:
        """Delete the ready images of every other size."""
        for image in self.directory.glob("*-*.img"):
            size = image.name.split("-", 1)[0]
            if not size.isdigit() or int(size) not in keep_sizes:
                image.unlink(missing_ok=True)

    def fill(self, size_bytes: int) -> int:
        """Format images of ``size_bytes`` until ``per_size`` are ready; return how many."""
        self.directory.mkdir(parents=True, exist_ok=True)
        made = 0
        while len(self._ready(size_bytes)) < self.per_size:
            staging = self.directory / f".{uuid.uuid4().hex}.tmp"
            try:
                format_image(staging, size_bytes)
                os.rename(staging, self.directory / f"{size_bytes}-{uuid.uuid4().hex}.img")
            finally:
                staging.unlink(missing_ok=True)
            made += 1
        return made


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
            syscalls.umount2(str(target), 0)
        except OSError:
            # still busy: detach now, freed (and the loop device cleared) when unused
            try:
                syscalls.umount2(str(target), syscalls.MNT_DETACH)
            except OSError as exc:
                raise QuotaError(f"cannot unmount {target}: {exc}") from exc
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
