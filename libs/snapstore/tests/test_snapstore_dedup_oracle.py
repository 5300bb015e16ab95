"""What a snapshot publishes about its size tells nothing of other tenants' snapshots.

The store dedups across every snapshot of its bucket, every tenant's. Before (found by an
adversarial review, 2026-12-07), ``snapshot.taken.bytes_uploaded`` (and the index row) was the
store's upload count: another tenant's file with the same content was not uploaded again, so a
tenant snapshotting one guess each time (``DB_PASSWORD=4719``, ``4720``, ...) read another
tenant's PIN off its own events (44 bytes against 61). It is now the content new to the
snapshot's own series: this tree and its own parent alone decide it."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from nacl.signing import SigningKey

from dsec_snapstore import SnapshotInputs, SnapshotStore
from dsec_snapstore.adapters.objectstore import S3ObjectStore
from dsec_snapstore.adapters.vault import VaultKeyStore
from dsec_snapstore.requests import taken_event

pytestmark = pytest.mark.integration


def test_a_snapshots_published_size_does_not_tell_what_another_tenant_stored(
    s3: Any, vault: Any, tmp_path: Path
) -> None:
    objects = S3ObjectStore(
        s3.endpoint, s3.access_key, s3.secret_key, s3.bucket, prefix=f"t-{uuid.uuid4().hex}/"
    )
    keys = VaultKeyStore(vault.addr, vault.token)
    with SnapshotStore(
        objects, signing_key=SigningKey.generate(), keys=keys, cache_dir=tmp_path / "cache"
    ) as store:
        beta = tmp_path / "beta"
        beta.mkdir()
        (beta / ".env").write_text("DB_PASSWORD=4721\n")
        store.create("beta-snap", SnapshotInputs(code_dir=beta, labels={"tenant": "beta"}))
        seen: dict[int, int] = {}
        stored: dict[int, int] = {}
        for pin in (4720, 4721, 4722):
            probe = tmp_path / f"probe-{pin}"
            probe.mkdir()
            (probe / "x.env").write_text(f"DB_PASSWORD={pin}\n")
            result = store.create(
                f"probe-{pin}", SnapshotInputs(code_dir=probe, labels={"tenant": "alpha"})
            )
            seen[pin] = taken_event(result).bytes_uploaded
            stored[pin] = result.bytes_uploaded
        # the store still dedups (the guess that hits uploads less) ...
        assert stored[4721] < stored[4720]
        # ... but what alpha reads is the same for every guess: its content, new to its series
        assert seen == {4720: 17, 4721: 17, 4722: 17}
        summaries = {
            s.name: s.bytes_uploaded for s in store.list_snapshots() if s.name.startswith("probe")
        }
        assert summaries == {"probe-4720": 17, "probe-4721": 17, "probe-4722": 17}

        # the figure still says what changed in a series: a second snapshot of one tree
        tree = tmp_path / "tree"
        tree.mkdir()
        (tree / "a.txt").write_text("a" * 1000)
        (tree / "b.txt").write_text("b" * 500)
        for written in tree.iterdir():  # (long before the snapshot: its stat cache trusts them)
            os.utime(written, (time.time() - 3600, time.time() - 3600))
        first = store.create("tree-1", SnapshotInputs(code_dir=tree))
        (tree / "b.txt").write_text("c" * 700)
        second = store.create("tree-2", SnapshotInputs(code_dir=tree))
        assert (first.bytes_new, second.bytes_new) == (1500, 700)
