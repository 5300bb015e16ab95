"""Reading a code bundle from a real object store: bounded by its spec, checked as it streams."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import blake3
import pytest
from dsec_core.objectstore import (
    BundleAltered,
    BundleTooLarge,
    ObjectMissing,
    fetch_bundle,
    get_bundle,
)
from dsec_core.settings import Settings

pytestmark = pytest.mark.integration


def _settings(s3: Any) -> Settings:
    return Settings(
        s3_endpoint=s3.endpoint,
        s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key,
        s3_bucket=s3.bucket,
    )


def _store(s3: Any, data: bytes) -> tuple[str, str]:
    digest = blake3.blake3(data).hexdigest()
    key = f"bundles/test-objectstore/{digest}.tar.zst"
    s3.client().put_object(s3.bucket, key, io.BytesIO(data), len(data))
    return key, digest


async def test_a_bundle_streams_to_a_file_checked_against_its_digest(
    s3: Any, tmp_path: Path
) -> None:
    data = os.urandom(3 << 20)
    key, digest = _store(s3, data)
    dest = tmp_path / "b.tar.zst"
    await fetch_bundle(_settings(s3), key, digest, dest, max_bytes=len(data))
    assert dest.read_bytes() == data
    assert await get_bundle(_settings(s3), key, digest, max_bytes=len(data)) == data


async def test_a_bundle_over_its_bound_is_refused_and_nothing_is_left(
    s3: Any, tmp_path: Path
) -> None:
    data = os.urandom(2 << 20)
    key, digest = _store(s3, data)
    dest = tmp_path / "b.tar.zst"
    with pytest.raises(BundleTooLarge, match=f"larger than {len(data) - 1} bytes"):
        await fetch_bundle(_settings(s3), key, digest, dest, max_bytes=len(data) - 1)
    assert not dest.exists()
    with pytest.raises(BundleTooLarge):
        await get_bundle(_settings(s3), key, digest, max_bytes=1024)


async def test_a_bundle_that_is_not_its_digest_or_missing_is_refused(
    s3: Any, tmp_path: Path
) -> None:
    key, _ = _store(s3, b"the real bytes")
    dest = tmp_path / "b.tar.zst"
    with pytest.raises(BundleAltered, match="does not match its digest"):
        await fetch_bundle(_settings(s3), key, "0" * 64, dest, max_bytes=1 << 20)
    assert not dest.exists()
    with pytest.raises(ObjectMissing):
        await fetch_bundle(_settings(s3), key + ".nope", "0" * 64, dest, max_bytes=1 << 20)
    assert not dest.exists()


@pytest.mark.unit
async def test_a_cancelled_fetch_leaves_no_file_and_spares_a_retrys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetch's thread runs on after its caller is cancelled (a stopping service) and used
    to finish the file, which nothing removed (up to 4 GiB a bundle); a first fix removed
    whatever was at the path when that thread ended, a retry's finished file included."""
    import asyncio
    import threading

    from dsec_core import objectstore

    release, finished = threading.Event(), threading.Event()
    calls: list[int] = []

    def scan(settings: Any, key: str, digest: str, consume: Any, *, max_bytes: int) -> Any:
        calls.append(1)
        if len(calls) == 1:
            release.wait(10)  # the store answers the first attempt after its caller has gone
        try:
            return consume(io.BytesIO(b"x" * 1000))
        finally:
            if len(calls) == 1 or release.is_set():
                finished.set()

    monkeypatch.setattr(objectstore, "scan_bundle", scan)
    dest = tmp_path / ".bundle.tar.zst"
    first = asyncio.create_task(objectstore.fetch_bundle(None, "k", "d", dest, max_bytes=10**6))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await objectstore.fetch_bundle(None, "k", "d", dest, max_bytes=10**6)  # type: ignore[arg-type]
    assert dest.read_bytes() == b"x" * 1000  # the retry's file
    release.set()
    await asyncio.to_thread(finished.wait, 10)
    await asyncio.sleep(0.05)  # the first thread's own clean-up, after its scan returned
    assert dest.read_bytes() == b"x" * 1000  # still there
    dest.unlink()
    assert list(tmp_path.iterdir()) == []  # no part file of either attempt


async def test_repeated_bundle_reads_reuse_one_connection(s3: Any) -> None:
    from urllib.parse import urlsplit

    from dsec_core.objectstore import shared_client

    data = os.urandom(64 << 10)
    key, digest = _store(s3, data)
    settings = _settings(s3)
    for _ in range(10):
        assert await get_bundle(settings, key, digest, max_bytes=len(data)) == data
    store = shared_client(settings)
    assert shared_client(_settings(s3)) is store  # equal settings, one client
    host = urlsplit(f"http://{s3.endpoint}")
    pool = store._http.connection_from_host(host.hostname, host.port, scheme="http")
    assert pool.num_connections == 1  # ten reads (a stat and a get each) over one connection
    other = Settings(
        s3_endpoint=s3.endpoint, s3_access_key=s3.access_key, s3_secret_key="another",
        s3_bucket=s3.bucket,
    )  # fmt: skip
    assert shared_client(other) is not store  # another key pair, another client
