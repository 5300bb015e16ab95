"""`dsec events archive` on a real stream and object store: archive + live verify as one log,
an altered archive is named, a lost NATS store comes back from the archive.

Each test gets a private stack (its own NATS and S3): what the tests do to the archive and the
stream (deleting the stream, altering segments) must not reach the session's stack.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_core import canonical, eventarchive, identity
from dsec_core.bus import EventPublisher, ensure_stream
from dsec_core.events import SandboxExited, SpecSubmitted
from dsec_core.subjects import STREAM
from dsec_core.trust import Gate, KeyRing
from dsec_testing import trust
from dsec_testing.stack import StackFixture
from nacl.signing import SigningKey
from nats.js import JetStreamContext

pytestmark = pytest.mark.integration

BUCKET = "archive-test"


@pytest.fixture
def private(tmp_path: Path) -> Iterator[StackFixture]:
    fixture = StackFixture(tmp_path / "home")
    try:
        yield fixture
    finally:
        fixture.discard()


@pytest.fixture
async def js(private: StackFixture) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(private.nats_url)
    js = nc.jetstream()
    await ensure_stream(js)
    yield js
    await nc.close()


@pytest.fixture
def cli(private: StackFixture, dsec_cli: Any, tmp_path: Path) -> Any:
    """``dsec`` against the private stack, trusting its root, S3 bucket :data:`BUCKET`."""
    s3 = private.s3
    env = {
        "DSEC_NATS_URL": private.nats_url,
        # The operator's machine: `events archive` signs the manifest with the operator key.
        "DSEC_HOME": str(trust.operator_cli_home(private.home, tmp_path / "cli")),
        "DSEC_TRUST_ROOT": bytes(trust.stack_root(private.home).verify_key).hex(),
        "DSEC_S3_ENDPOINT": s3.endpoint,
        "DSEC_S3_ACCESS_KEY": s3.access_key,
        "DSEC_S3_SECRET_KEY": s3.secret_key,
        "DSEC_S3_BUCKET": BUCKET,
    }

    def invoke(*args: str) -> Any:
        return dsec_cli(*args, env=env)

    return invoke


def _anchor(private: StackFixture) -> bytes:
    return bytes(trust.stack_root(private.home).verify_key)


async def _traffic(
    js: JetStreamContext, home: Path, n: int
) -> tuple[EventPublisher, EventPublisher]:
    """A user submitting and a node agent reporting exits: ``2 + 2n`` messages."""
    user = await trust.publisher(js, home, "user", subject="user-alpha")
    agent = await trust.publisher(js, home, "nodeagent", node_id="n1")
    await _more(user, agent, n, "a")
    return user, agent


async def _more(user: EventPublisher, agent: EventPublisher, n: int, tag: str) -> None:
    for i in range(n):
        await user.publish(SpecSubmitted(spec_yaml=f"v{i}"), aggregate_id=f"sbx_{tag}{i}")
        exited = SandboxExited(exit_code=0, reason="ok", duration_s=i)
        await agent.publish(exited, aggregate_id=f"sbx_{tag}x{i}")


async def test_archive_then_live_verify_as_one_log(js, private, cli, verifier_kind) -> None:
    user, agent = await _traffic(js, private.home, 5)  # seq 1..12
    done = cli("events", "archive", "--upto", "10", "--segment-events", "4", "--json")
    assert done.exit_code == 0, done.output
    first = done.last_json()
    assert first["archived_events"] == 10 and (first["first_seq"], first["last_seq"]) == (1, 10)
    assert len(first["segments"]) == 3  # 4 + 4 + 2

    # Later traffic from producers whose keys were registered before the archive's cut.
    await _more(user, agent, 3, "b")  # seq 13..18
    again = cli("events", "archive", "--json").last_json()
    assert (again["first_seq"], again["last_seq"], again["archived_upto"]) == (11, 18, 18)
    assert cli("events", "archive", "--json").last_json()["archived_events"] == 0
    await _more(user, agent, 1, "c")  # seq 19..20, only in the live stream

    listed = cli("events", "archived", "--json")
    assert listed.exit_code == 0, listed.output
    summary = listed.last_json()
    assert summary["verified"] and summary["events"] == 18
    assert [s["first_seq"] for s in summary["segments"]] == [1, 5, 9, 11]

    verified = cli("audit", "verify", "--archive", "--json")
    assert verified.exit_code == 0, verified.output
    report = verified.last_json()
    assert report["ok"] and report["injected"] == []
    assert (report["first_seq"], report["last_seq"], report["archived_upto"]) == (1, 20, 18)
    assert report["events"] == 20 and report["producers"] == ["nodeagent", "user-alpha"]

    # The archive holds the stored bytes: every archived message is the stream's, exactly.
    store = private.s3.client()
    manifest = await eventarchive.read_manifest(store, BUCKET, _anchor(private))
    assert manifest is not None
    async for record in eventarchive.archived_records(store, BUCKET, manifest):
        stored = await js.get_msg(STREAM, record.seq)
        assert (record.subject, record.data) == (stored.subject, stored.data)

    # A service's gate still takes new events of a producer registered before the cut.
    nc = await nats.connect(private.nats_url)
    try:
        gate = Gate(
            KeyRing(nc, nc.jetstream(), trust.stack_root(private.home).verify_key.encode()),
            nc.jetstream(),
            None,
        )
        late = await user.publish(SpecSubmitted(spec_yaml="late"), aggregate_id="sbx_z")
        admitted = await gate.admit(late.sealed.wire, stream_seq=late.stream_seq)
        assert getattr(admitted, "id", None) == late.envelope.id
    finally:
        await nc.close()


async def test_archive_before_a_time(js, private, cli) -> None:
    await _traffic(js, private.home, 3)  # seq 1..8
    cut = (await js.get_msg(STREAM, 5)).time
    assert cut is not None
    done = cli("events", "archive", "--before", cut.isoformat(), "--json")
    assert done.exit_code == 0, done.output
    assert done.last_json()["last_seq"] == 4  # stored strictly before message 5
    past = (cut + timedelta(days=1)).isoformat()
    assert cli("events", "archive", "--before", past, "--json").last_json()["last_seq"] == 8


def _rewrite(store: Any, key: str, change: Any) -> bytes:
    """Rewrite one archived segment object through ``change(records) -> records``."""
    response = store.get_object(BUCKET, key)
    blob = response.read()
    response.close()
    altered = eventarchive.pack_segment(change(eventarchive.unpack_segment(blob)))
    import io

    store.put_object(BUCKET, key, io.BytesIO(altered), len(altered))
    return altered


async def test_altered_archive_is_named(js, private, cli, verifier_kind) -> None:
    await _traffic(js, private.home, 4)  # seq 1..10; the agent's exits at 4, 6, 8, 10
    assert cli("events", "archive", "--segment-events", "5", "--json").exit_code == 0
    store = private.s3.client()
    manifest = await eventarchive.read_manifest(store, BUCKET, _anchor(private))
    assert manifest is not None
    segment = manifest.segments[1]  # seq 6..10

    def flip_exit(records: list[eventarchive.Record]) -> list[eventarchive.Record]:
        out = []
        for r in records:
            if r.seq == 6:  # a node agent's exit, rewritten from 0 to 1
                fields = canonical.unpack(r.data)
                fields["payload"]["exit_code"] = 1
                r = eventarchive.Record(r.seq, r.subject, r.stored_us, canonical.pack(fields))
            out.append(r)
        return out

    altered = await asyncio.to_thread(_rewrite, store, segment.key, flip_exit)

    listed = cli("events", "archived", "--json")
    assert listed.exit_code == 1
    assert f"archived segment {segment.key} (seq 6-10) was altered" in listed.output
    verified = cli("audit", "verify", "--archive", "--json")
    assert verified.exit_code == 1
    assert verified.last_json()["first_bad"]["seq"] == 6
    assert "was altered: BLAKE3" in verified.last_json()["first_bad"]["reason"]

    # Whoever can also rewrite the manifest cannot sign it: refused as tampering.
    import blake3

    forged = eventarchive.Manifest(
        segments=[
            s
            if s.key != segment.key
            else eventarchive.Segment(
                **{**s.__dict__, "blake3": blake3.blake3(altered).hexdigest(), "size": len(altered)}
            )
            for s in manifest.segments
        ],
        last_hash=manifest.last_hash,
        prev=manifest.prev,
    )
    await eventarchive.objectstore.put_bytes(
        store, BUCKET, eventarchive.MANIFEST_KEY, forged.to_bytes()
    )
    for args in (("events", "archived", "--json"), ("audit", "verify", "--archive", "--json")):
        refused = cli(*args)
        assert refused.exit_code == 1, refused.output
        assert "manifest.json is not signed" in " ".join(refused.output.split())

    # ... nor keep the operator's signature over other segment hashes.
    resigned = dataclasses.replace(forged, cert=manifest.cert, sig=manifest.sig)
    await eventarchive.objectstore.put_bytes(
        store, BUCKET, eventarchive.MANIFEST_KEY, resigned.to_bytes()
    )
    refused = cli("audit", "verify", "--archive", "--json")
    assert refused.exit_code == 1
    assert "the operator's signature does not match it" in " ".join(refused.output.split())

    # A key the root certified for another role (a node agent's) signs nothing here either.
    agent_key = SigningKey.generate()
    forged.sign(
        agent_key,
        identity.issue(
            trust.stack_root(private.home),
            bytes(agent_key.verify_key),
            subject="nodeagent",
            role="nodeagent",
            node_id="n1",
        ),
    )
    await eventarchive.objectstore.put_bytes(
        store, BUCKET, eventarchive.MANIFEST_KEY, forged.to_bytes()
    )
    refused = cli("events", "archived", "--json")
    assert refused.exit_code == 1
    assert "role nodeagent), not by the operator" in " ".join(refused.output.split())


async def test_manifests_chain_and_pin_the_last_message(js, private, cli) -> None:
    """Each manifest records the one it replaced and the BLAKE3 of the last archived message;
    where the live stream still holds that sequence, it must be that message."""
    await _traffic(js, private.home, 2)  # seq 1..6
    assert cli("events", "archive", "--upto", "3", "--json").exit_code == 0
    store = private.s3.client()
    first = await eventarchive.read_manifest(store, BUCKET, _anchor(private))
    assert first is not None and first.prev is None and first.last_seq == 3
    assert first.last_hash == eventarchive.message_hash((await js.get_msg(STREAM, 3)).data)
    assert cli("events", "archive", "--json").exit_code == 0
    second = await eventarchive.read_manifest(store, BUCKET, _anchor(private))
    assert second is not None and second.prev == first.digest() and second.last_seq == 6
    summary = cli("events", "archived", "--json").last_json()
    assert summary["signed_by"] == "operator" and summary["last_hash"] == second.last_hash
    assert summary["digest"] == second.digest() and summary["prev"] == first.digest()

    verified = cli("audit", "verify", "--archive", "--json")
    assert verified.exit_code == 0, verified.output
    assert verified.last_json()["archived_upto"] == 6

    # What the signature cannot rule out, the holder of the operator key signing another last
    # message, is found while the live stream still holds that sequence.
    last = second.segments[-1]
    blob = await eventarchive.objectstore.get_bytes(store, BUCKET, last.key)
    records = eventarchive.check_segment(last, blob)
    other = eventarchive.Record(6, records[-1].subject, records[-1].stored_us, b"\x90")
    segment, data = eventarchive.make_segment([*records[:-1], other])
    await eventarchive.objectstore.put_bytes(store, BUCKET, segment.key, data)
    lying = dataclasses.replace(
        second,
        segments=[*second.segments[:-1], segment],
        last_hash=eventarchive.message_hash(other.data),
        prev=second.digest(),
    )
    signer = trust.archive_signer(private.home)
    lying.sign(signer.key, signer.cert)
    await eventarchive.objectstore.put_bytes(
        store, BUCKET, eventarchive.MANIFEST_KEY, lying.to_bytes()
    )
    assert cli("events", "archived", "--json").exit_code == 0  # signed, consistent
    verified = cli("audit", "verify", "--archive", "--json")
    assert verified.exit_code == 1, verified.output
    bad = verified.last_json()["first_bad"]
    assert bad["seq"] == 6 and "is not the live stream's" in bad["reason"], bad


async def test_lost_stream_is_restored_from_the_archive(js, private, cli) -> None:
    await _traffic(js, private.home, 4)  # seq 1..10
    before = cli("audit", "verify", "--json").last_json()
    assert cli("events", "archive", "--json").last_json()["archived_upto"] == 10
    originals = {seq: (await js.get_msg(STREAM, seq)).data for seq in range(1, 11)}

    refused = cli("events", "restore", "--json")  # the stream still holds the log
    assert refused.exit_code == 2 and "must be empty" in refused.output

    await js.delete_stream(STREAM)  # the NATS store is lost
    restored = cli("events", "restore", "--json")
    assert restored.exit_code == 0, restored.output
    assert restored.last_json()["restored_upto"] == 10
    for seq, data in originals.items():
        assert (await js.get_msg(STREAM, seq)).data == data
    after = cli("audit", "verify", "--json")
    assert after.exit_code == 0, after.output
    assert after.last_json() == before


async def test_no_archive_is_a_clear_error(js, private, cli) -> None:
    await _traffic(js, private.home, 1)
    result = cli("audit", "verify", "--archive", "--json")
    assert result.exit_code == 2
    assert f"no event archive in bucket '{BUCKET}'" in result.output


async def test_retention_per_subject_after_archiving(js, private, cli) -> None:
    """Approved `max_msgs_per_subject`: repeats on one subject go, keys and sandboxes stay;
    the archive taken before keeps the whole log verifiable."""
    user, agent = await _traffic(js, private.home, 1)  # seq 1..4
    exited = SandboxExited(exit_code=0, reason="ok", duration_s=1)
    for _ in range(5):  # what repeats on one subject, as node heartbeats do: seq 5..9
        await agent.publish(exited, aggregate_id="sbx_hot")

    refused = cli("nats", "stream", "--max-msgs-per-subject", "2", "--json")
    assert refused.exit_code == 2 and "--approve-discard" in refused.output
    assert cli("events", "archive", "--json").last_json()["archived_upto"] == 9
    limited = cli("nats", "stream", "--max-msgs-per-subject", "2", "--approve-discard", "--json")
    assert limited.exit_code == 0, limited.output
    assert limited.last_json() == {
        "stream": STREAM,
        "problems": [],
        "limits": {"max_msgs_per_subject": 2},
    }
    state = (await js.stream_info(STREAM)).state
    assert state.messages == 6  # the hot subject's 3 oldest are gone; every other one stays
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.get_msg(STREAM, 5)

    # Producers registered before keep working: their registrations were never discarded.
    late = await user.publish(SpecSubmitted(spec_yaml="late"), aggregate_id="sbx_late")
    nc = await nats.connect(private.nats_url)
    try:
        anchor = trust.stack_root(private.home).verify_key.encode()
        gate = Gate(KeyRing(nc, nc.jetstream(), anchor), nc.jetstream(), None)
        admitted = await gate.admit(late.sealed.wire, stream_seq=late.stream_seq)
        assert getattr(admitted, "id", None) == late.envelope.id
    finally:
        await nc.close()

    live_only = cli("audit", "verify", "--json")  # the stream alone has holes now
    assert live_only.exit_code == 1
    assert live_only.last_json()["first_bad"]["reason"] == "gap: sequence 5 missing"
    human = cli("audit", "verify")
    assert human.exit_code == 1 and "verify with --archive" in human.output
    human = cli("audit", "verify", "--archive")
    assert human.exit_code == 0 and "(seq ≤ 9 from the archive)" in " ".join(human.output.split())
    whole = cli("audit", "verify", "--archive", "--json")
    assert whole.exit_code == 0, whole.output
    assert whole.last_json()["events"] == 10 and whole.last_json()["last_seq"] == 10

    assert cli("events", "archive", "--json").last_json()["archived_upto"] == 10
    lifted = cli("nats", "stream", "--no-limits", "--json").last_json()
    assert lifted["limits"] == {} and lifted["problems"] == []


async def test_two_archive_runs_at_once_do_not_interleave(js, private) -> None:
    await _traffic(js, private.home, 3)  # seq 1..8
    store = private.s3.client()
    signer = trust.archive_signer(private.home)
    await eventarchive.archive(js, store, BUCKET, signer=signer, upto=2)

    def other_run(segment: eventarchive.Segment) -> None:
        # Another run appends segment 5-6 after this run listed its first segment (3-4).
        if segment.first_seq == 3:
            theirs = eventarchive.Manifest.parse(
                store.get_object(BUCKET, eventarchive.MANIFEST_KEY).read()
            )
            seg, _ = eventarchive.make_segment(
                [eventarchive.Record(s, "dsec.x", 0, b"") for s in range(5, 7)]
            )
            theirs.segments.append(seg)
            data = theirs.to_bytes()
            import io

            store.put_object(BUCKET, eventarchive.MANIFEST_KEY, io.BytesIO(data), len(data))

    with pytest.raises(eventarchive.ArchiveError, match="another archive run wrote"):
        await eventarchive.archive(
            js, store, BUCKET, signer=signer, segment_events=2, progress=other_run
        )
