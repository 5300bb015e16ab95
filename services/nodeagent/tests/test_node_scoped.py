"""A node agent acts only on the sandboxes placed on its node, and stages their environments
from the object store (real NATS, SeaweedFS, kernel sandboxes)."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from dsec_core import events
from dsec_core.envarchive import pack
from dsec_core.envelope import Envelope
from dsec_core.layout import NodeLayout
from dsec_core.natsperms import durable_name
from dsec_core.objectstore import env_archive_key
from dsec_core.subjects import STREAM, subject_for
from dsec_core.trust import handled_key
from nats.js.errors import NotFoundError
from prometheus_client import REGISTRY

sys.path.insert(0, str(Path(__file__).parent))
from _nodeagent_harness import NodeAgentHarness

pytestmark = [pytest.mark.integration, pytest.mark.kernel]

QUIET = "{cidr: 10.77.0.0/16, ports: [80]}"


@pytest.fixture
def home() -> Iterator[Path]:
    """A short home: the sandboxes' socket paths must fit in AF_UNIX's 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dns-", dir="/tmp"))
    yield path / "home"
    shutil.rmtree(path, ignore_errors=True)


def _stored_env(tmp: Path, s3: Any, value: str) -> events.EnvBuilt:
    """An environment holding module ``stagedmod`` (``VALUE = value``) stored as the builder
    stores it; returns its ``env.built``."""
    root = tmp / f"env-{value}"
    (root / "site-packages").mkdir(parents=True)
    (root / "site-packages" / "stagedmod.py").write_text(f"VALUE = {value!r}\n")
    (root / "env.json").write_text("{}")
    lock_hash = uuid.uuid4().hex
    packed = pack(root, tmp / f"{lock_hash}.tar.zst")
    key = env_archive_key(lock_hash)
    s3.client().fput_object(s3.bucket, key, str(tmp / f"{lock_hash}.tar.zst"))
    return events.EnvBuilt(
        lock_hash=lock_hash,
        fingerprint="test",
        object_key=key,
        digest=packed.digest,
        size_bytes=packed.size_bytes,
        unpacked_bytes=packed.unpacked_bytes,
        reused=False,
    )


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.05)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _handled(h: NodeAgentHarness, event_type: str, event: Envelope) -> bool:
    """Whether this node agent's durable for ``event_type`` handled (and acked) ``event``
    (a user's event is recorded by its key and id, a service's by id)."""
    kv = await h._nc.jetstream().key_value("dsec-handled")
    durable = durable_name("nodeagent", event_type, h.settings.node_id)
    try:
        await kv.get(handled_key(durable, event, user=event.producer.startswith("user-")))
    except Exception:
        return False
    return True


async def _in_log(h: NodeAgentHarness, event_type: str, sid: str) -> bool:
    try:
        await h._nc.jetstream().get_last_msg(STREAM, subject_for(event_type, sid))
    except NotFoundError:
        return False
    return True


async def test_a_fresh_node_stages_the_environment_from_s3_once_per_lock(
    home: Path, nats_url: str, s3: Any, tmp_path: Path
) -> None:
    built = _stored_env(tmp_path, s3, "from-s3")
    code = "import stagedmod, sys; sys.exit(0 if stagedmod.VALUE == 'from-s3' else 3)"
    starts = _sample("dsec_sandbox_starts_total", outcome="started")
    timed = _sample("dsec_sandbox_start_seconds_count", stage="total")
    async with NodeAgentHarness(home, nats_url, **s3.settings()) as h:
        sid = await h.submit("staged", code, QUIET, built=built)
        ready = await h.wait_for(sid, "sandbox.ready")
        exited = await h.wait_for(sid, "sandbox.exited")
        assert exited.payload["exit_code"] == 0, exited.payload
        assert ready.payload["start_latency_ms"]["env_stage"] > 0
        layout = NodeLayout.of(home)
        assert (layout.env_site_packages(built.lock_hash) / "stagedmod.py").is_file()
        # the second sandbox of the lock uses the staged copy: the archive is not needed again
        s3.client().remove_object(s3.bucket, built.object_key)
        again = await h.submit("staged-again", code, QUIET, built=built)
        assert (await h.wait_for(again, "sandbox.exited")).payload["exit_code"] == 0
    assert sorted(p.name for p in layout.envs.iterdir() if p.name != h.lock_hash) == [
        ".incoming",
        built.lock_hash,
    ]
    # the start is counted and its latency, by stage, is in dsec_sandbox_start_seconds
    assert _sample("dsec_sandbox_starts_total", outcome="started") == starts + 2
    assert _sample("dsec_sandbox_start_seconds_count", stage="total") == timed + 2
    assert _sample("dsec_sandbox_start_seconds_count", stage="env_stage") >= 1
    assert REGISTRY.get_sample_value("dsec_sandboxes_running") is not None


async def test_a_corrupted_archive_fails_the_sandbox_and_leaves_nothing_half_unpacked(
    home: Path, nats_url: str, s3: Any, tmp_path: Path
) -> None:
    genuine = _stored_env(tmp_path, s3, "genuine")
    altered = genuine.model_copy(update={"digest": blake3.blake3(b"other bytes").hexdigest()})
    failed_starts = _sample("dsec_sandbox_starts_total", outcome="failed")
    async with NodeAgentHarness(home, nats_url, **s3.settings()) as h:
        sid = await h.submit("corrupt", "print(1)", QUIET, built=altered)
        await _until(lambda: _in_log(h, "sandbox.failed", sid), "sandbox.failed")
        (failed,) = h.recorded[sid].of("sandbox.failed")
    assert _sample("dsec_sandbox_starts_total", outcome="failed") == failed_starts + 1
    assert "does not match its env.built" in failed.payload["reason"]
    assert "altered or corrupted" in failed.payload["reason"]
    assert h.recorded[sid].of("sandbox.ready") == []
    envs = NodeLayout.of(home).envs
    assert not (envs / genuine.lock_hash).exists()
    assert [p.name for p in envs.iterdir() if p.name.startswith(f".{genuine.lock_hash}")] == []
    assert list((envs / ".incoming").iterdir()) == []


async def test_a_sandbox_scheduled_on_another_node_is_neither_started_nor_stopped_here(
    home: Path, nats_url: str
) -> None:
    async with NodeAgentHarness(home, nats_url) as h:
        sid = await h.submit("elsewhere", "print(1)", QUIET, node_id="other-node")
        scheduled = h.scheduled[sid].envelope
        await _until(lambda: _handled(h, "sandbox.scheduled", scheduled), "scheduled acked")
        stop = await h.upstream.user.publish(
            events.SandboxStopRequested(requested_by="test"), aggregate_id=sid
        )
        await _until(lambda: _handled(h, "sandbox.stop_requested", stop.envelope), "stop acked")
        assert [
            a.envelope.type for a in h.recorded[sid].events if a.envelope.producer == "nodeagent"
        ] == []
        assert not await _in_log(h, "sandbox.exited", sid)
        assert not NodeLayout.of(home).sandbox(sid).root.exists()
        assert h.agent.manager.get(sid) is None


def _events_of(h: NodeAgentHarness, sid: str) -> list[str]:
    return [a.envelope.type for a in h.recorded[sid].events]


async def _rescheduled_elsewhere(h: NodeAgentHarness, sid: str) -> None:
    """What the scheduler publishes when this node is declared lost: ``unit.lost``, then the
    sandbox placed on another node."""
    cause = h.scheduled[sid].envelope
    lost = events.UnitLost(
        node_id=h.settings.node_id, reason="node lost", action="reschedule", attempt=1
    )
    await h.upstream.scheduler.publish(lost, aggregate_id=sid, causation=cause)
    moved = events.SandboxScheduled(node_id="node-b", attempt=2, previous_node=h.settings.node_id)
    await h.upstream.scheduler.publish(moved, aggregate_id=sid, causation=cause)


async def test_a_copy_whose_placement_was_lost_is_stopped_without_any_event(
    home: Path, nats_url: str
) -> None:
    async with NodeAgentHarness(home, nats_url) as h:
        sid = await h.submit("fenced", "import time; time.sleep(60)", QUIET)
        await h.wait_for(sid, "sandbox.ready")
        running = _sample("dsec_sandboxes_running")  # every agent of this process, summed
        assert running >= 1
        await _rescheduled_elsewhere(h, sid)

        async def gone() -> bool:
            return h.agent.manager.get(sid) is None and sid not in h.agent._fenced

        await _until(gone, "the stale copy stopped")
        assert _sample("dsec_sandboxes_running") == running - 1
        assert not NodeLayout.of(home).sandbox(sid).run.exists()
        assert not await _in_log(h, "sandbox.exited", sid)
    assert "sandbox.exited" not in _events_of(h, sid)


async def test_a_node_agent_restarted_after_its_sandbox_moved_stops_the_stale_copy(
    home: Path, nats_url: str
) -> None:
    async with NodeAgentHarness(home, nats_url) as first:
        sid = await first.submit("moved", "import time; time.sleep(60)", QUIET)
        await first.wait_for(sid, "sandbox.ready")
        await first.stop_agent()  # a crash or partition: the sandbox keeps running
        assert NodeLayout.of(home).sandbox(sid).run.exists()
        await _rescheduled_elsewhere(first, sid)
        async with NodeAgentHarness(home, nats_url) as second:
            # reconcile at start re-adopted it, read its fold (placed on node-b) and fenced it
            await _until(lambda: _stopped(second, sid), "the stale copy stopped after the restart")
            assert not NodeLayout.of(home).sandbox(sid).run.exists()
            assert not await _in_log(second, "sandbox.exited", sid)


async def _stopped(h: NodeAgentHarness, sid: str) -> bool:
    return h.agent.manager.get(sid) is None and sid not in h.agent._fenced


async def test_a_stop_of_a_sandbox_scheduled_here_that_has_not_started_ends_it_stopped(
    home: Path, nats_url: str
) -> None:
    async with NodeAgentHarness(home, nats_url) as h:
        # hold this node's staging of the harness environment: the tenant's first three
        # launches (all its share of the launch workers) wait in it, and its fourth waits for
        # one of them, taken from the bus but not started
        lock = h.agent.envs._locks.setdefault(h.lock_hash, asyncio.Lock())
        async with lock:
            first = [await h.submit(f"held{n}", "print(1)", QUIET) for n in range(3)]
            for sid in first:
                await _until(lambda sid=sid: _starting(h, sid), "a start waits in staging")
            waiting = await h.submit("waiting", "print(2)", QUIET)
            scheduled = h.scheduled[waiting].envelope
            await _until(lambda: _handled(h, "sandbox.scheduled", scheduled), "taken, held")
            assert not await _starting(h, waiting)
            stop = await h.upstream.user.publish(
                events.SandboxStopRequested(requested_by="test"), aggregate_id=waiting
            )
            exited = await h.wait_for(waiting, "sandbox.exited")
            assert not await _starting(h, waiting)
        assert exited.payload["reason"] == "stopped"
        assert "before it started" in exited.payload["detail"]
        assert exited.causation_id == stop.envelope.id
        for sid in first:
            await h.wait_for(sid, "sandbox.exited")
        # its scheduled event, started after the stop, starts nothing
        await h.service.settled()
        assert _events_of(h, waiting).count("sandbox.ready") == 0
        assert h.agent.manager.get(waiting) is None


async def test_a_stop_of_a_sandbox_still_starting_ends_its_start_at_once(
    home: Path, nats_url: str, s3: Any, tmp_path: Path
) -> None:
    """A sandbox whose environment is still staging (minutes on a cold node; here its staging
    is held) is stopped by its stop request at once: the start ends there, its steps undone,
    the sandbox ends in `sandbox.exited` (stopped, before it started) and never becomes ready.
    Before, the stop waited for the start to finish, and every stop on the node after it
    waited too (stops are taken in order)."""
    built = _stored_env(tmp_path, s3, "stopped")
    async with NodeAgentHarness(home, nats_url, **s3.settings()) as h:
        lock = h.agent.envs._locks.setdefault(built.lock_hash, asyncio.Lock())
        async with lock:
            sid = await h.submit("cold", "print(1)", QUIET, built=built)
            await _until(lambda: _starting(h, sid), "its start waits in staging")
            stop = await h.upstream.user.publish(
                events.SandboxStopRequested(requested_by="test"), aggregate_id=sid
            )
            exited = await h.wait_for(sid, "sandbox.exited", timeout_s=20)
            assert not await _starting(h, sid)
        assert exited.payload["reason"] == "stopped"
        assert "before it started" in exited.payload["detail"]
        assert exited.causation_id == stop.envelope.id
        await h.service.settled()
        assert _events_of(h, sid).count("sandbox.ready") == 0
        assert _events_of(h, sid).count("sandbox.failed") == 0
        assert h.agent.manager.get(sid) is None
        assert sid not in h.agent._rules and sid not in h.agent._attempts
        # the staging it had begun goes on, for the next sandbox of its lock
        site = NodeLayout.of(home).env_site_packages(built.lock_hash)

        async def staged() -> bool:
            return (site / "stagedmod.py").is_file()

        await _until(staged, "the environment staged")


async def test_a_launch_still_staging_holds_no_other_launch_of_its_node(
    home: Path, nats_url: str, s3: Any, tmp_path: Path
) -> None:
    """A cold environment still staging (a multi-GB download; here its staging is held)
    holds only its own launch: the launches scheduled after it start and end meanwhile. Before,
    the node agent took launches in fetched batches, the next batch only once the whole batch
    had ended, so they waited for it."""
    built = _stored_env(tmp_path, s3, "slow")
    async with NodeAgentHarness(home, nats_url, **s3.settings()) as h:
        lock = h.agent.envs._locks.setdefault(built.lock_hash, asyncio.Lock())
        async with lock:
            code = "import stagedmod, sys; sys.exit(0 if stagedmod.VALUE == 'slow' else 3)"
            slow = await h.submit("slow", code, QUIET, built=built)
            await _until(lambda: _starting(h, slow), "the slow start waits in staging")
            after = [await h.submit(f"after{n}", "print(2)", QUIET) for n in range(2)]
            for sid in after:
                exited = await h.wait_for(sid, "sandbox.exited", timeout_s=30)
                assert exited.payload["exit_code"] == 0
            assert h.recorded[slow].of("sandbox.ready") == []
        assert (await h.wait_for(slow, "sandbox.exited")).payload["exit_code"] == 0


async def _starting(h: NodeAgentHarness, sid: str) -> bool:
    return sid in h.agent._starting


async def test_what_a_start_warns_about_reaches_its_user_in_sandbox_ready(
    home: Path, nats_url: str
) -> None:
    missing = f"/nonexistent-{uuid.uuid4().hex[:8]}/data"
    async with NodeAgentHarness(home, nats_url) as h:
        sid = await h.submit(
            "warned",
            "print(1)",
            QUIET,
            extra=f"  filesystem:\n    read_allowed: [{missing}]\n",  # (under security_policy)
        )
        ready = await h.wait_for(sid, "sandbox.ready")
        quiet = await h.submit("unwarned", "print(1)", QUIET)
        plain = await h.wait_for(quiet, "sandbox.ready")
    assert ready.payload["warnings"] == [
        f"read_allowed {missing} exists neither in a mount nor on the host"
    ]
    assert plain.payload["warnings"] == []
