"""A disk quota for a sandbox's writable directories: a loop-mounted ext4 image of its own.

The host's filesystem (ext4 mounted without ``prjquota`` here; often the root filesystem) offers
no per-directory quota, and a tmpfs would put the outputs in memory and lose them at exit. So each
sandbox with writable directories gets a sparse image file ``DSEC_HOME/sandboxes/<id>/disk.img``
of ``resources.disk`` bytes, formatted ext4 (no journal, no reserved blocks, lazy inode tables:
~7 ms) and loop-mounted (``nosuid,nodev``; ~8 ms) at ``DSEC_HOME/sandboxes/<id>/fs``, where the
writable directories are created. A write beyond the quota fails with ``ENOSPC`` inside the
sandbox; the host's disk never sees more than the image's used blocks. The node agent keeps a
few images of the sizes recently asked for formatted and mounted ahead (:class:`ImagePool`), so
a start only renames one and bind-mounts it (:func:`take_mounted`).

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
    taken = pool.take(size_bytes, image, target) if pool is not None else None
    if taken is None:
        format_image(image, size_bytes)
    if not taken:  # formatted here, or a pooled image that was not mounted ahead
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


WARM_DIRS = 4


def _warm(mount: Path) -> None:
    """Make and remove a few directories at the root of a pooled image's new filesystem: the
    metadata a start's first ``mkdir`` there needs (the block groups' bitmaps and inode tables
    the allocator spreads directories over) is then cached, instead of read through the loop
    device's worker on the start path (~0.1 ms a directory, several ms under I/O load)."""
    for index in range(WARM_DIRS):
        path = mount / f".dsec-warm-{index}"
        path.mkdir()
        path.rmdir()


def take_mounted(data_dir: Path, size_bytes: int, pool: ImagePool) -> bool:
    """:func:`create` without any slow step, or nothing: when ``pool`` holds a mounted image of
    ``size_bytes`` and no earlier outputs of this sandbox must be carried over, move it in (a
    rename and a bind mount, ~0.1 ms: cheaper than a worker thread's hand-off) and return
    ``True``; else ``False`` (call :func:`create`)."""
    image, target = data_dir / IMAGE_NAME, mount_point(data_dir)
    previous = data_dir / f".{MOUNT_NAME}.previous"
    if previous.exists() or (target.exists() and not _empty_dir(target)):
        return False
    data_dir.mkdir(parents=True, exist_ok=True)
    target.mkdir(exist_ok=True)
    if pool.take(size_bytes, image, target, mounted_only=True):
        return True
    with contextlib.suppress(OSError):
        target.rmdir()
    return False


def _empty_dir(path: Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except NotADirectoryError:
        return False


class ImagePool:
    """Formatted, unused images of the sizes recently asked for, already attached to a loop
    device and mounted, so that neither mkfs nor the loop attach and ext4 mount is on a
    sandbox's start path.

    Kept under ``DSEC_HOME/cache/disk-images`` (the data directories' filesystem: taking an
    image is a rename): ``<size>-<id>.img`` is a ready image, mounted (``nosuid,nodev``, its
    ``lost+found`` removed) at ``mnt/<size>-<id>`` when the kernel allowed it. Taking one renames
    the image into the sandbox's data directory (the claim: a concurrent taker finds it gone),
    bind-mounts its filesystem at the sandbox's mount point and detaches the pool's mount, so the
    sandbox's mount is the only one left and unmounting it at the sandbox's end frees the loop
    device (auto-clear) as before. :meth:`clear` unmounts and deletes everything (node agent
    shutdown, and at start after a crash): no loop device, mount or file stays behind.
    """

    def __init__(self, directory: Path, per_size: int = 2) -> None:
        self.directory = directory
        self.mounts = directory / "mnt"
        self.per_size = per_size
        self._taken: list[Path] = []  # pool mounts of taken images, detached by the next fill

    def _ready(self, size_bytes: int) -> list[Path]:
        return sorted(self.directory.glob(f"{size_bytes}-*.img"))

    def has_mounted(self, size_bytes: int) -> bool:
        """Whether a mounted image of ``size_bytes`` is ready (a few ``stat`` calls)."""
        try:
            ready = self._ready(size_bytes)
        except OSError:
            return False
        return any(os.path.ismount(self.mounts / image.stem) for image in ready)

    def take(
        self, size_bytes: int, dest: Path, target: Path | None = None, *, mounted_only: bool = False
    ) -> bool | None:
        """Move a formatted image of ``size_bytes`` to ``dest``: ``None`` when none is ready;
        ``True`` when it was mounted ahead and its filesystem is now mounted at ``target``;
        ``False`` when it still has to be mounted (or no ``target`` was given)."""
        try:
            ready = self._ready(size_bytes)
        except OSError:
            return None
        for image in ready:
            mount = self.mounts / image.stem
            mounted = os.path.ismount(mount)
            if mounted_only and not mounted:
                continue
            try:
                os.rename(image, dest)
            except FileNotFoundError:  # taken by a concurrent start
                continue
            except OSError:  # another filesystem than the data directories (EXDEV): format
                return None
            if not mounted:
                return False
            if target is None:  # the caller mounts the image itself: drop the pool's mount
                self._unmount(mount)
                return False
            try:
                syscalls.mount(str(mount), str(target), None, syscalls.MS_BIND, None)
            except OSError:  # mount it the usual way (the pool's mount goes below)
                self._unmount(mount)
                return False
            # Detaching the pool's mount (up to ~2 ms: the kernel waits out an RCU grace
            # period) is left to the next fill, off the start path: the image is claimed.
            self._taken.append(mount)
            return True
        return None

    def detach_taken(self) -> None:
        """Detach the pool's mounts of the images taken since (their sandboxes keep theirs)."""
        while self._taken:
            self._unmount(self._taken.pop())

    @staticmethod
    def _unmount(mount: Path) -> None:
        with contextlib.suppress(OSError):
            syscalls.umount2(str(mount), syscalls.MNT_DETACH)
        with contextlib.suppress(OSError):
            mount.rmdir()

    def prune(self, keep_sizes: set[int]) -> None:
        """Delete the ready images of every other size (each claimed first, like a take)."""
        for image in self.directory.glob("*-*.img"):
            size = image.name.split("-", 1)[0]
            if not size.isdigit() or int(size) not in keep_sizes:
                self._drop(image)

    def _drop(self, image: Path) -> None:
        try:
            os.rename(image, image.with_suffix(".dropping"))  # claimed: no start takes it now
        except FileNotFoundError:
            return
        self._unmount(self.mounts / image.stem)
        image.with_suffix(".dropping").unlink(missing_ok=True)

    def _drop_orphan_mounts(self) -> None:
        """Mounts no ready image claims: left by a node agent that died (only while no start
        can take an image: a claimed image's mount is its taker's until it detached it)."""
        try:
            names = os.listdir(self.mounts)
        except FileNotFoundError:
            return
        for name in names:
            if not (self.directory / f"{name}.img").exists():
                self._unmount(self.mounts / name)

    def fill(self, size_bytes: int) -> int:
        """Format (and mount) images of ``size_bytes`` until ``per_size`` are ready; return how
        many were made."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.detach_taken()
        made = 0
        while len(self._ready(size_bytes)) < self.per_size:
            name = f"{size_bytes}-{uuid.uuid4().hex}"
            staging = self.directory / f".{name}.tmp"
            mount = self.mounts / name
            try:
                format_image(staging, size_bytes)
                self.mounts.mkdir(exist_ok=True)
                mount.mkdir()
                try:
                    mount_image(staging, mount)
                    with contextlib.suppress(FileNotFoundError):
                        (mount / "lost+found").rmdir()
                    _warm(mount)
                except QuotaError:  # no loop device here: a start mounts it (slower)
                    mount.rmdir()
                os.rename(staging, self.directory / f"{name}.img")  # ready from now on
            except BaseException:
                self._unmount(mount)
                raise
            finally:
                staging.unlink(missing_ok=True)
            made += 1
        return made

    def clear(self) -> None:
        """Unmount and delete every pooled image (the loop devices are freed with them).

        Only while nothing takes from the pool: at the node agent's start and shutdown."""
        self.detach_taken()
        if not self.directory.is_dir():
            return
        for image in self.directory.glob("*-*.img"):
            self._drop(image)
        self._drop_orphan_mounts()
        for leftover in (*self.directory.glob(".*.tmp"), *self.directory.glob("*.dropping")):
            leftover.unlink(missing_ok=True)


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
