"""The snapshot service's own decisions (pure): what a delete that keeps failing answers, and
which snapshots are a sandbox's periodic series."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from dsec_core import events
from dsec_core.signing import Signer
from dsec_snapstore.manifest import SnapshotSummary
from nacl.signing import SigningKey

from dsec_snapshot.app import not_deleted
from dsec_snapshot.deletes import SnapshotDeletes
from dsec_snapshot.periodic import periodic_series

pytestmark = pytest.mark.unit


def test_a_delete_that_keeps_failing_still_ends_in_snapshot_deleted() -> None:
    request = events.SnapshotDeleteRequested(names=["a", "b"], gc=True)
    envelope = Signer("user-x", SigningKey.generate()).seal(request, aggregate_id="del-1").envelope
    (answer,) = not_deleted(envelope, "S3 unreachable", 4)
    assert isinstance(answer, events.SnapshotDeleted) and answer.TERMINAL
    assert answer.names == [] and answer.missing == ["a", "b"]


async def test_a_delete_delivered_again_after_failing_halfway_reports_its_own_deletions() -> None:
    """S3 fails after the first of three names: the request is delivered again, and the name
    the first attempt deleted is reported deleted (not "missing": the user would read that no
    such snapshot of theirs existed)."""
    stored = {"a", "b", "c"}
    fail_on = ["b"]

    class Deletes(SnapshotDeletes):
        async def _delete_one(self, name: str, tenant: str) -> bool:
            if name in fail_on:
                fail_on.remove(name)
                raise ConnectionError("S3 unreachable")
            if name not in stored:
                return False
            stored.discard(name)
            return True

    deletes = Deletes(None)  # type: ignore[arg-type]  # (the store is _delete_one's, above)
    request = events.SnapshotDeleteRequested(names=["a", "b", "c", "z"])
    envelope = Signer("user-x", SigningKey.generate()).seal(request, aggregate_id="del-2").envelope
    with pytest.raises(ConnectionError):
        await deletes.on_delete_requested(envelope, request)
    (given_up,) = not_deleted(envelope, "S3 unreachable", 4, deletes.deleted_by(envelope.id))
    assert isinstance(given_up, events.SnapshotDeleted)  # (had it given up here instead)
    assert given_up.names == ["a"] and given_up.missing == ["b", "c", "z"]
    (answer,) = await deletes.on_delete_requested(envelope, request)  # the redelivery
    assert isinstance(answer, events.SnapshotDeleted)
    assert answer.names == ["a", "b", "c"] and answer.missing == ["z"] and stored == set()


def row(name: str, **labels: str) -> SnapshotSummary:
    return SnapshotSummary(
        name=name,
        id=name,
        created_at=datetime.now(UTC),
        series="s",
        files=1,
        bytes_total=1,
        bytes_uploaded=1,
        manifest_digest="d",
        labels=labels,
    )


def test_a_sandboxs_periodic_series_is_its_own_labelled_snapshots_only() -> None:
    rows = [
        row("auto-sbx_1-1", periodic="auto-sbx_1"),
        row("auto-sbx_12-1", periodic="auto-sbx_12"),  # another sandbox, same name prefix
        row("by-hand"),
        row("auto-sbx_1-fake"),  # a user's snapshot named like one: not labelled periodic
    ]
    assert [r.name for r in periodic_series(rows, "sbx_1")] == ["auto-sbx_1-1"]
