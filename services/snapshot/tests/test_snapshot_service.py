"""The snapshot service's own decisions (pure): what a delete that keeps failing answers, and
which snapshots are a sandbox's periodic series."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from dsec_core import events
from dsec_core.signing import Signer
from dsec_snapstore.errors import SnapshotError, StoreBusy, StoreUnavailable
from dsec_snapstore.manifest import SnapshotSummary
from dsec_snapstore.results import GcReport
from nacl.signing import SigningKey

from dsec_snapshot import periodic
from dsec_snapshot.app import not_deleted
from dsec_snapshot.deletes import SnapshotDeletes
from dsec_snapshot.periodic import periodic_series

pytestmark = pytest.mark.unit


def test_a_delete_that_keeps_failing_still_ends_in_snapshot_deleted() -> None:
    request = events.SnapshotDeleteRequested(names=["a", "b"], gc=True)
    envelope = Signer("user-x", SigningKey.generate()).seal(request, aggregate_id="del-1").envelope
    (answer,) = not_deleted(envelope, "S3 unreachable", 4)
    assert isinstance(answer, events.SnapshotDeleted) and answer.TERMINAL
    assert answer.names == [] and answer.failed == ["a", "b"] and answer.missing == []
    assert answer.gc_grace_s is None and answer.gc_skipped == "gave_up"  # (gc was asked)


class _Store:
    """What the delete handler and the periodic GC ask of the store, failing as told."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.collected = 0

    def gc(self, grace: timedelta = timedelta(hours=1)) -> GcReport:
        if self.failures:
            raise self.failures.pop(0)
        self.collected += 1
        return GcReport(
            objects_stored=0, objects_referenced=0, deleted=(), bytes_freed=0, dry_run=False
        )


@pytest.mark.parametrize(
    ("failure", "skipped"),
    [(StoreBusy("locked by locks/shared-1.json"), "busy"), (SnapshotError("bad"), "unreadable")],
)
async def test_a_gc_that_did_not_run_says_why(failure: Exception, skipped: str) -> None:
    deletes = SnapshotDeletes(
        SimpleNamespace(  # type: ignore[arg-type]
            store=_Store(failure), settings=SimpleNamespace(snapshot_gc_min_grace_s=0.0)
        )
    )
    request = events.SnapshotDeleteRequested(gc=True, gc_grace_s=0)
    envelope = Signer("user-x", SigningKey.generate()).seal(request, aggregate_id="del-3").envelope
    (answer,) = await deletes.on_delete_requested(envelope, request)
    assert isinstance(answer, events.SnapshotDeleted)
    assert answer.gc_grace_s is None and answer.gc_skipped == skipped


async def test_a_gc_whose_store_fails_is_tried_again_not_reported_done() -> None:
    store = _Store(StoreUnavailable("S3 unreachable"))
    deletes = SnapshotDeletes(
        SimpleNamespace(  # type: ignore[arg-type]
            store=store, settings=SimpleNamespace(snapshot_gc_min_grace_s=0.0)
        )
    )
    request = events.SnapshotDeleteRequested(gc=True, gc_grace_s=0)
    envelope = Signer("user-x", SigningKey.generate()).seal(request, aggregate_id="del-4").envelope
    with pytest.raises(StoreUnavailable):  # the bus delivers it again
        await deletes.on_delete_requested(envelope, request)
    (answer,) = await deletes.on_delete_requested(envelope, request)
    assert isinstance(answer, events.SnapshotDeleted)
    assert answer.gc_grace_s == 0 and answer.gc_skipped is None and store.collected == 1


async def test_a_periodic_gc_kept_out_by_a_busy_store_is_owed_until_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Retention deleted snapshots once; the GC it made due found the store busy. The next
    ticks delete nothing more, yet the GC is tried again (soon, not in GC_EVERY_S) until it
    runs, once."""
    monkeypatch.setattr(periodic, "GC_EVERY_S", 0.0)
    monkeypatch.setattr(periodic, "GC_BUSY_RETRY_S", 0.0)
    store = _Store(StoreBusy("locked"), StoreBusy("locked"))
    stored = ["auto-sbx_1-1", "auto-sbx_1-2"]  # the older goes (keep=1)

    class Store(_Store):
        def list_snapshots(self) -> list[SnapshotSummary]:
            return [
                row(n, periodic="auto-sbx_1").model_copy(
                    update={"created_at": datetime(2026, 12, 1, i, tzinfo=UTC)}
                )
                for i, n in enumerate(stored)
            ]

        def delete(self, name: str) -> None:
            stored.remove(name)

    store.__class__ = Store
    snapshots = periodic.PeriodicSnapshots(
        SimpleNamespace(store=store),
        _no_publish,
        3600.0,
        keep=1,  # type: ignore[arg-type]
    )
    snapshots.running.add("sbx_1")
    snapshots._last_asked["sbx_1"] = time.monotonic()  # (asked just now: nothing is due)
    for _ in range(4):
        await snapshots.tick()
    assert stored == ["auto-sbx_1-2"] and store.failures == [] and store.collected == 1


async def _no_publish(*_: object) -> None:
    raise AssertionError("nothing is due")


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
    (given_up,) = not_deleted(envelope, "S3 unreachable", 4, deletes.outcome(envelope))
    assert isinstance(given_up, events.SnapshotDeleted)  # (had it given up here instead)
    assert given_up.names == ["a"] and given_up.failed == ["b", "c", "z"]
    (answer,) = await deletes.on_delete_requested(envelope, request)  # the redelivery
    assert isinstance(answer, events.SnapshotDeleted)
    assert answer.names == ["a", "b", "c"] and answer.missing == ["z"] and stored == set()


async def test_a_delete_that_gives_up_reports_what_it_found_missing_as_missing() -> None:
    """Only the names it could not get to are ``failed`` (they may exist); one it found absent
    before the store failed is ``missing`` (the CLI's exit 2, not 3)."""

    class Deletes(SnapshotDeletes):
        async def _delete_one(self, name: str, tenant: str) -> bool:
            if name == "b":
                raise ConnectionError("S3 unreachable")
            return name == "a"

    deletes = Deletes(None)  # type: ignore[arg-type]
    request = events.SnapshotDeleteRequested(names=["z", "a", "b"])
    envelope = Signer("user-x", SigningKey.generate()).seal(request, aggregate_id="del-5").envelope
    with pytest.raises(ConnectionError):
        await deletes.on_delete_requested(envelope, request)
    (given_up,) = not_deleted(envelope, "S3", 4, deletes.outcome(envelope))
    assert isinstance(given_up, events.SnapshotDeleted)
    assert (given_up.names, given_up.missing, given_up.failed) == (["a"], ["z"], ["b"])


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


def test_one_tenants_long_delete_holds_no_other_tenants(tmp_path: Path) -> None:
    """A delete request named any number of snapshots, and the service handled deletes one at a
    time in stream order: one request of 20,000 names held every tenant's `dsec snapshot rm`
    31 s (found by an adversarial review, 2026-12-07). A request names at most 1,000 now; the
    deletes run two at once, one per tenant, each attempt cancelled past its timeout."""
    import pydantic
    from dsec_core.settings import Settings

    from dsec_snapshot.app import DELETE_TIMEOUT_S, create_service

    events.SnapshotDeleteRequested(names=[f"s{i}" for i in range(events.MAX_DELETE_NAMES)])
    with pytest.raises(pydantic.ValidationError, match="at most 1000 items"):
        events.SnapshotDeleteRequested(names=[f"s{i}" for i in range(20_000)])
    service = create_service(Settings(home=tmp_path))
    (fair,) = [f for f in service._fair if f.handling.event_type == "snapshot.delete_requested"]
    assert fair.workers == 2 and fair.queue.per_tenant_running == 1
    assert fair.handling.policy.attempt_timeout_s == DELETE_TIMEOUT_S
