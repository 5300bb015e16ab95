"""Snapshots without a shared disk: who acts on a snapshot request, and deletes over the bus.

A request about a sandbox another node runs is acked and left alone by this node's agent (and
by the snapshot service); ``dsec snapshot rm`` / ``gc`` ask the snapshot service, which answers
``snapshot.deleted`` and removes the objects, and never deletes another tenant's snapshots.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nats
import pytest
from dsec_core import identity
from dsec_core.bus import replay
from dsec_core.envelope import decode
from dsec_core.events import (
    SandboxReady,
    SandboxScheduled,
    SnapshotRequested,
    SpecSubmitted,
    SpecValidated,
)
from dsec_core.ids import new_sandbox_id
from dsec_core.natsperms import durable_name
from dsec_core.subjects import STREAM, aggregate_filter
from dsec_snapstore.adapters.objectstore import S3ObjectStore
from dsec_snapstore.locks import StoreLocks
from dsec_snapstore.manifest import SignedManifest, manifest_key, summary_key
from dsec_snapstore.packs import PackIndex
from dsec_testing import trust
from dsec_testing.plans import minimal_plan

if TYPE_CHECKING:
    from dsec_testing.stack import S3Info, ServiceRunner, StackFixture

pytestmark = [pytest.mark.e2e]


def snapshot_of_dir(dsec_cli: Any, env: dict[str, str], tmp_path: Path) -> str:
    code = tmp_path / f"code-{uuid.uuid4().hex[:6]}"
    code.mkdir()
    (code / "agent.py").write_text(f"TOKEN = {uuid.uuid4().hex!r}\n")  # chunks of its own
    name = f"rm-{uuid.uuid4().hex[:8]}"
    created = dsec_cli("snapshot", "create", "--dir", str(code), "--name", name, env=env)
    assert created.exit_code == 0, created.output
    return name


def stored(s3: S3Info, key: str) -> bool:
    from minio.error import S3Error

    try:
        s3.client().stat_object(s3.bucket, key)
    except S3Error as exc:
        if exc.code == "NoSuchKey":
            return False
        raise
    return True


def chunk_keys(s3: S3Info, name: str) -> list[str]:
    """The packs holding the snapshot's chunks (per the pack index)."""
    raw = s3.client().get_object(s3.bucket, manifest_key(name)).read()
    manifest = SignedManifest.model_validate_json(raw).manifest
    index = PackIndex(S3ObjectStore(s3.endpoint, s3.access_key, s3.secret_key, s3.bucket))
    index.refresh()
    locs = [index.lookup(c) for c in manifest.all_chunks()]
    assert all(loc is not None for loc in locs), "a chunk in no pack"
    return sorted({loc.pack for loc in locs if loc is not None})


def test_rm_and_gc_go_through_the_snapshot_service_and_the_objects_are_gone(
    services: ServiceRunner, stack_env: dict[str, str], dsec_cli: Any, s3: S3Info, tmp_path: Path
) -> None:
    # (the operator lets a GC asked for on the bus collect packs of any age)
    services.start("snapshot", env={"DSEC_SNAPSHOT_GC_MIN_GRACE_S": "0"})
    env = dict(stack_env)
    name = snapshot_of_dir(dsec_cli, env, tmp_path)
    chunks = chunk_keys(s3, name)
    assert chunks and all(stored(s3, k) for k in chunks)

    removed = dsec_cli("snapshot", "rm", name, "--yes", "--json", env=env)
    assert removed.exit_code == 0, removed.output
    answer = removed.last_json()
    assert answer["event"] == "snapshot.deleted"
    assert answer["names"] == [name] and answer["missing"] == []
    assert not stored(s3, manifest_key(name)) and not stored(s3, summary_key(name))
    assert dsec_cli("snapshot", "verify", name, env=env).exit_code == 2  # unknown now

    collected = dsec_cli("snapshot", "gc", "--grace", "0s", "--yes", "--json", env=env)
    assert collected.exit_code == 0, collected.output
    assert collected.last_json()["chunks_removed"] >= len(chunks)
    assert collected.last_json()["gc_grace_s"] == 0  # the grace asked for: no minimum here
    assert not any(stored(s3, k) for k in chunks)

    again = dsec_cli("snapshot", "rm", name, "--yes", env=env)
    assert again.exit_code == 2
    assert f"no snapshot named {name}" in " ".join(again.output.split())


def test_a_gc_while_a_snapshot_is_taken_elsewhere_collects_nothing_and_says_so(
    services: ServiceRunner, stack_env: dict[str, str], dsec_cli: Any, s3: S3Info, tmp_path: Path
) -> None:
    """A snapshot being taken on another host (its shared lock in the bucket) holds the store:
    the service's GC waits for it (here 0.5 s), gives up and deletes nothing; `dsec snapshot gc`
    says so and exits 1 (it used to print "freed 0 objects", exit 0). Free again, it collects."""
    services.start(
        "snapshot",
        env={"DSEC_SNAPSHOT_GC_MIN_GRACE_S": "0", "DSEC_SNAPSHOT_GC_WAIT_S": "0.5"},
    )
    env = dict(stack_env)
    name = snapshot_of_dir(dsec_cli, env, tmp_path)
    chunks = chunk_keys(s3, name)
    assert dsec_cli("snapshot", "rm", name, "--yes", env=env).exit_code == 0
    elsewhere = StoreLocks(S3ObjectStore(s3.endpoint, s3.access_key, s3.secret_key, s3.bucket))
    with elsewhere.shared(5.0, "snapshot create on another host"):
        told = dsec_cli("snapshot", "gc", "--grace", "0s", "--yes", env=env)
        assert told.exit_code == 1, told.output
        assert "did not collect: the store was busy" in " ".join(told.output.split())
        assert all(stored(s3, k) for k in chunks)
        asked = dsec_cli("snapshot", "gc", "--grace", "0s", "--yes", "--json", env=env)
        assert asked.exit_code == 1, asked.output
        assert asked.last_json()["gc_grace_s"] is None
        assert asked.last_json()["gc_skipped"] == "busy"
    collected = dsec_cli("snapshot", "gc", "--grace", "0s", "--yes", "--json", env=env)
    assert collected.exit_code == 0, collected.output
    assert not any(stored(s3, k) for k in chunks)


def test_a_gc_asked_with_no_grace_keeps_young_packs_another_snapshot_may_be_naming(
    services: ServiceRunner, stack_env: dict[str, str], dsec_cli: Any, s3: S3Info, tmp_path: Path
) -> None:
    """Packs a snapshot being taken has uploaded are named by no manifest yet; a GC anyone can
    ask for would delete them with `--grace 0s`. The snapshot service applies at least its
    minimum grace (1 h by default): young packs stay, whatever the request says."""
    services.start("snapshot")
    env = dict(stack_env)
    name = snapshot_of_dir(dsec_cli, env, tmp_path)
    chunks = chunk_keys(s3, name)
    assert dsec_cli("snapshot", "rm", name, "--yes", env=env).exit_code == 0
    collected = dsec_cli("snapshot", "gc", "--grace", "0s", "--yes", "--json", env=env)
    assert collected.exit_code == 0, collected.output
    assert collected.last_json()["chunks_removed"] == 0
    assert collected.last_json()["gc_grace_s"] == 3600  # raised, and the answer says so
    assert chunks and all(stored(s3, k) for k in chunks)
    told = dsec_cli("snapshot", "gc", "--grace", "0s", "--yes", env=env)
    assert told.exit_code == 0, told.output
    assert "kept everything younger than 1h, not 0s" in " ".join(told.output.split())


def test_a_user_of_another_tenant_cannot_delete_a_snapshot(
    services: ServiceRunner,
    stack_env: dict[str, str],
    dsec_cli: Any,
    dsec_stack: StackFixture,
    s3: S3Info,
    tmp_path: Path,
) -> None:
    services.start("snapshot")
    env = dict(stack_env)
    name = snapshot_of_dir(dsec_cli, env, tmp_path)  # tenant "default" (the test user's)

    key, cert = identity.issue_user(trust.stack_root(dsec_stack.home), "mallory", "acme")
    cred = tmp_path / "acme.cred.json"
    cred.write_text(identity.credential_json(key, cert))
    cred.chmod(0o600)
    refused = dsec_cli(
        "snapshot", "rm", name, "--yes", "--json", env={**env, "DSEC_CREDENTIAL": str(cred)}
    )
    assert refused.exit_code == 2, refused.output
    answer = refused.last_json()
    # reported like a snapshot that does not exist: no oracle for other tenants' names
    assert answer["names"] == [] and answer["missing"] == [name]
    assert stored(s3, manifest_key(name))

    owned = dsec_cli("snapshot", "rm", name, "--yes", "--json", env=env)
    assert owned.exit_code == 0 and owned.last_json()["names"] == [name]


async def settled(js: Any, durable: str, timeout: float = 80.0) -> None:
    """Wait until ``durable`` has nothing undelivered or unacknowledged. A request that an
    earlier test's instance fetched just as it stopped is delivered again only after the
    consumer's ack_wait (60 s for snapshot requests), and holds the ack floor until then."""
    deadline = time.monotonic() + timeout
    while True:
        info = await js.consumer_info(STREAM, durable)
        if not info.num_pending and not info.num_ack_pending:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{durable} still has {info.num_ack_pending} unacknowledged")
        await asyncio.sleep(0.1)


async def consumed(js: Any, durable: str, seq: int, timeout: float = 20.0) -> None:
    """Wait until ``durable`` acknowledged the message at stream ``seq`` (and all before)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = await js.consumer_info(STREAM, durable)
        except nats.js.errors.NotFoundError:
            info = None
        if info is not None and info.ack_floor.stream_seq >= seq and not info.num_ack_pending:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{durable} did not acknowledge seq {seq} within {timeout} s")
        await asyncio.sleep(0.1)


@pytest.mark.kernel
async def test_a_snapshot_request_for_a_sandbox_of_another_node_is_left_to_that_node(
    services: ServiceRunner, nats_url: str, dsec_stack: StackFixture, make_publisher: Any
) -> None:
    services.start("nodeagent", "snapshot")  # this node is node-1
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        node_durable = durable_name("nodeagent", "snapshot.requested", "node-1")
        for durable in (node_durable, "snapshot-snapshot-requested"):
            await settled(js, durable)  # (what earlier tests left is not this test's)
        user = await make_publisher(js)
        policy = await make_publisher(js, role="policy")
        scheduler = await make_publisher(js, role="scheduler")
        node2 = await trust.publisher(js, dsec_stack.home, "nodeagent", node_id="node-2")
        sid = new_sandbox_id()
        submitted = await user.publish(SpecSubmitted(spec_yaml="name: x"), aggregate_id=sid)
        validated = SpecValidated(name="x", spec_digest="d", plan=minimal_plan())
        await policy.publish(validated, aggregate_id=sid, causation=submitted.envelope)
        placed = SandboxScheduled(node_id="node-2")
        await scheduler.publish(placed, aggregate_id=sid, causation=submitted.envelope)
        ready = SandboxReady(node_id="node-2", pid=1, cgroup="/cg", code_dir="/elsewhere/code")
        await node2.publish(ready, aggregate_id=sid, causation=submitted.envelope)
        request = await user.publish(SnapshotRequested(name=f"n2-{sid}"), aggregate_id=sid)
        seq = request.stream_seq

        await consumed(js, node_durable, seq)
        await consumed(js, "snapshot-snapshot-requested", seq)
        seen = [
            decode(data)
            async for _, data in replay(js, filter_subject=aggregate_filter("sandbox", sid))
        ]
        types = [e.type for e in seen]
        assert "snapshot.requested" in types
        # node-1 saw it and acked it; the snapshot service too: node-2's to answer, not theirs
        assert not {"snapshot.taken", "snapshot.failed", "sandbox.failed"} & set(types), [
            (e.type, e.producer) for e in seen
        ]
    finally:
        await nc.close()


def test_rm_without_a_snapshot_service_times_out_naming_it(
    stack_env: dict[str, str], dsec_cli: Any
) -> None:
    result = dsec_cli(
        "snapshot", "rm", "nobody-answers", "--yes", "--timeout", "1", env=dict(stack_env)
    )
    assert result.exit_code == 4, result.output
    assert "is the snapshot service running?" in " ".join(result.output.split())
