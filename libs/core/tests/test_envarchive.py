"""Environment archives: what the builder packs is what a node unpacks, and nothing else."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
import zstandard
from dsec_core.envarchive import EnvArchiveError, digest_file, pack, unpack
from dsec_core.objectstore import env_archive_key


def _env(root: Path) -> Path:
    site = root / "site-packages" / "pkg"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("VALUE = 1\n")
    (site / "data.bin").write_bytes(os.urandom(4096))
    os.symlink("__init__.py", site / "alias.py")
    (root / "env.json").write_text("{}")
    return root


def _archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    return path


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, None


def test_key_is_content_addressed_by_lock_hash() -> None:
    assert env_archive_key("abcdef0123456789") == "envs/abcdef0123456789.tar.zst"
    with pytest.raises(ValueError, match=r"lock hash '\.\./x'"):
        env_archive_key("../x")


def test_pack_then_unpack_gives_the_same_tree(tmp_path: Path) -> None:
    src = _env(tmp_path / "src")
    packed = pack(src, tmp_path / "a.tar.zst")
    assert digest_file(tmp_path / "a.tar.zst") == (packed.digest, packed.size_bytes)
    dest = tmp_path / "envs" / "lock1234"
    dest.parent.mkdir()
    written = unpack(tmp_path / "a.tar.zst", dest, max_bytes=packed.unpacked_bytes)
    assert written == packed.unpacked_bytes
    pkg = dest / "site-packages" / "pkg"
    assert (pkg / "__init__.py").read_text() == "VALUE = 1\n"
    assert (pkg / "data.bin").read_bytes() == (src / "site-packages/pkg/data.bin").read_bytes()
    assert os.readlink(pkg / "alias.py") == "__init__.py"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["lock1234"]  # no temp dir left


def test_packing_is_deterministic(tmp_path: Path) -> None:
    src = _env(tmp_path / "src")
    assert pack(src, tmp_path / "a").digest == pack(src, tmp_path / "b").digest


def test_packing_refuses_a_link_out_of_the_environment(tmp_path: Path) -> None:
    src = _env(tmp_path / "src")
    os.symlink("/etc/passwd", src / "site-packages" / "out")
    with pytest.raises(EnvArchiveError, match="site-packages/out: link to '/etc/passwd'"):
        pack(src, tmp_path / "a")


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (_file("../escape.py", b"x"), "absolute or escaping path"),
        (_file("/abs.py", b"x"), "absolute or escaping path"),
        (_link("site-packages/l", "../../outside"), "leaves the environment"),
        (_link("site-packages/l", "/etc"), "leaves the environment"),
    ],
)
def test_unpack_refuses_unsafe_members_and_leaves_nothing(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes | None], why: str
) -> None:
    archive = _archive(tmp_path / "bad.tar.zst", [_file("site-packages/ok.py", b"1"), member])
    envs = tmp_path / "envs"
    envs.mkdir()
    with pytest.raises(EnvArchiveError, match=why):
        unpack(archive, envs / "lock1234", max_bytes=1 << 20)
    assert list(envs.iterdir()) == []
    assert not (tmp_path / "escape.py").exists()


def test_unpack_refuses_a_write_through_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    members = [_link("d", "."), _file("d/x.py", b"x")]  # the link stays inside; the write not
    archive = _archive(tmp_path / "bad.tar.zst", members)
    (tmp_path / "envs").mkdir()
    with pytest.raises(EnvArchiveError, match="symlink"):
        unpack(archive, tmp_path / "envs" / "lock1234", max_bytes=1 << 20)
    assert list((tmp_path / "envs").iterdir()) == []


def test_unpack_stops_past_the_announced_size(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "big.tar.zst", [_file("a", b"x" * 1000), _file("b", b"y" * 10)])
    (tmp_path / "envs").mkdir()
    with pytest.raises(EnvArchiveError, match="unpacks past the 1005 bytes"):
        unpack(archive, tmp_path / "envs" / "lock1234", max_bytes=1005)
    assert list((tmp_path / "envs").iterdir()) == []


def test_a_truncated_archive_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    packed_path = tmp_path / "a.tar.zst"
    pack(_env(tmp_path / "src"), packed_path)
    data = packed_path.read_bytes()
    packed_path.write_bytes(data[: len(data) // 2])
    (tmp_path / "envs").mkdir()
    with pytest.raises(EnvArchiveError, match="not a valid environment archive"):
        unpack(packed_path, tmp_path / "envs" / "lock1234", max_bytes=1 << 20)
    assert list((tmp_path / "envs").iterdir()) == []
