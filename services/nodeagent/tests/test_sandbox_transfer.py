"""The copier of ``dsec sandbox cp`` run here, outside a sandbox (the e2e tests in
``tests/test_remote_access.py`` run it confined): which paths it goes to, which links it does
not follow, its limits, its record stream."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from dsec_nodeagent.sandbox import transfer

pytestmark = pytest.mark.unit


def _spec(tmp: Path, **over: Any) -> dict[str, Any]:
    spec = {
        "op": "get",
        "path": str(tmp / "w"),
        "name": "",
        "read_dirs": [str(tmp / "w"), str(tmp / "code")],
        "write_dirs": [str(tmp / "w")],
        "max_bytes": 1 << 20,
        "max_files": 100,
    }
    return {**spec, **over}


def _serve(spec: dict[str, Any], stdin: bytes = b"") -> tuple[int, list[tuple[bytes, bytes]]]:
    """Run the copier with pipes; its exit code and every record it wrote."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    chunks: list[bytes] = []

    def read() -> None:
        while data := os.read(out_r, 65536):
            chunks.append(data)

    def write() -> None:
        with os.fdopen(in_w, "wb") as fh:
            fh.write(stdin)

    threads = [threading.Thread(target=read), threading.Thread(target=write)]
    for t in threads:
        t.start()
    try:
        code = transfer.serve(spec, in_r, out_w)
    finally:
        os.close(out_w)
        for t in threads:
            t.join(10)
        os.close(in_r)
        os.close(out_r)
    return code, transfer.Reader().feed(b"".join(chunks))


def _error(records: list[tuple[bytes, bytes]]) -> str:
    assert records and records[-1][0] == b"E"
    return records[-1][1].decode()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    w = tmp_path / "w"
    (w / "sub").mkdir(parents=True)
    (w / "a.txt").write_text("alpha")
    (w / "sub" / "b.bin").write_bytes(os.urandom(100_000))
    (tmp_path / "secret").write_text("host secret")
    (w / "link").symlink_to(tmp_path / "secret")
    (w / "dirlink").symlink_to(tmp_path)
    (tmp_path / "code").mkdir()
    return tmp_path


def test_a_directory_comes_out_whole_without_its_links(tree: Path) -> None:
    code, records = _serve(_spec(tree))

    assert code == 0 and _error(records) == ""
    entries = [(k, transfer.parse_entry(p)[1]) for k, p in records if k in (b"D", b"F")]
    assert entries == [(b"D", ""), (b"F", "a.txt"), (b"D", "sub"), (b"F", "sub/b.bin")]
    skipped = sorted(p.decode() for k, p in records if k == b"X")
    assert skipped == ["dirlink", "link"]
    data = b"".join(p for k, p in records if k == b"B")
    assert data == b"alpha" + (tree / "w" / "sub" / "b.bin").read_bytes()
    assert b"host secret" not in data


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("{t}/secret", "outside the directories a copy may read"),
        ("{t}/w/../secret", "without '..'"),
        ("{t}/w/link", "is a symlink; not followed"),
        ("{t}/w/dirlink/secret", "symlink or not a directory; not followed"),
        ("{t}/w/missing", "No such file"),
    ],
)
def test_a_get_goes_nowhere_else(tree: Path, path: str, expected: str) -> None:
    code, records = _serve(_spec(tree, path=path.format(t=tree)))

    assert code == 1
    assert expected in _error(records)
    assert not any(b"host secret" in p for _, p in records)


def _put_stream(*records: bytes) -> bytes:
    return b"".join(records) + transfer.record(b"E")


def test_a_put_lands_inside_an_existing_directory(tree: Path) -> None:
    stream = _put_stream(
        transfer.entry(b"D", 0o755, ""),
        transfer.entry(b"F", 0o640, "x.txt"),
        transfer.record(b"B", b"hello "),
        transfer.record(b"B", b"world"),
        transfer.entry(b"D", 0o755, "deep"),
        transfer.entry(b"F", 0o600, "deep/y"),
    )
    code, records = _serve(_spec(tree, op="put", name="incoming"), stream)

    assert code == 0, _error(records)
    assert (tree / "w" / "incoming" / "x.txt").read_text() == "hello world"
    assert (tree / "w" / "incoming" / "deep" / "y").read_bytes() == b""
    assert (tree / "w" / "incoming" / "x.txt").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(
    ("path", "records", "expected"),
    [
        ("{t}/code/x", [transfer.entry(b"F", 0o644, "")], "may write"),
        ("{t}/w/link", [transfer.entry(b"F", 0o644, "")], "is a symlink; not followed"),
        ("{t}/w/dirlink/x", [transfer.entry(b"F", 0o644, "")], "not followed"),
        (
            "{t}/w/new",
            [transfer.entry(b"D", 0o755, ""), transfer.entry(b"F", 0o644, "../escape")],
            "not a plain relative path",
        ),
    ],
)
def test_a_put_writes_nowhere_else(
    tree: Path, path: str, records: list[bytes], expected: str
) -> None:
    spec = _spec(tree, op="put", name="x", path=path.format(t=tree))
    code, out = _serve(spec, _put_stream(*records))

    assert code == 1
    assert expected in _error(out)
    assert (tree / "secret").read_text() == "host secret"
    assert not (tree / "escape").exists() and not (tree / "x").exists()


def test_a_put_does_not_write_through_a_link_inside_what_it_creates(tree: Path) -> None:
    """A sandbox process races the copy: a link where the copy's directory goes."""
    stream = _put_stream(
        transfer.entry(b"D", 0o755, ""),
        transfer.entry(b"F", 0o644, "d/secret"),
        transfer.record(b"B", b"overwritten"),
    )
    (tree / "w" / "t").mkdir()
    (tree / "w" / "t" / "d").symlink_to(tree)
    code, out = _serve(_spec(tree, op="put", name="t", path=str(tree / "w")), stream)
    assert code == 1 and "not followed" in _error(out)
    assert (tree / "secret").read_text() == "host secret"


def test_limits_end_a_copy(tree: Path) -> None:
    code, records = _serve(_spec(tree, max_bytes=50_000))
    assert code == 1 and "more than 50000 bytes" in _error(records)

    code, records = _serve(_spec(tree, max_files=2))
    assert code == 1 and "more than 2 files" in _error(records)


def test_a_malformed_stream_is_an_error_not_a_crash() -> None:
    with pytest.raises(transfer.TransferError):
        transfer.Reader().feed(b"Q\0\0\0\1x")
    with pytest.raises(transfer.TransferError):
        transfer.Reader().feed(b"B\xff\xff\xff\xff")
    assert transfer.Reader().feed(b"B\0\0\0\5ab") == []  # incomplete: waits for more
