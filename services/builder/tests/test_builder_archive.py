"""``deps.resolved`` → ``env.built``: one environment archive per lock in the object store (real
SeaweedFS), built once for the cluster and reused by every later spec with the same lock."""

from __future__ import annotations

import io
import uuid
from pathlib import Path
from typing import Any

import blake3
import pytest
from _dsec_builder_testkit import WheelIndex
from dsec_core import events
from dsec_core.objectstore import env_archive_key
from dsec_core.settings import Settings
from dsec_core.signing import Signer
from nacl.signing import SigningKey
from prometheus_client import REGISTRY

from dsec_builder.handlers import BuilderHandlers
from dsec_builder.models import Target

pytestmark = pytest.mark.integration


def _resolved(index: WheelIndex) -> events.DepsResolved:
    tag = uuid.uuid4().hex[:8]  # a lock of this test's own: the bucket is the session's
    packages = [index.add(f"dsecarch{i}", "1.0", f"value-{i}-{tag}") for i in range(2)]
    target = Target()
    return events.DepsResolved(
        lock=[
            events.LockedPackage(name=p.name, version=p.version, sha256=p.sha256, source=p.url)
            for p in packages
        ],
        lock_hash="computed-by-the-builder",
        python=target.python_version,
        platform=target.platform,
        resolve_ms=0.0,
    )


def _handlers(home: Path, s3: Any) -> BuilderHandlers:
    settings = Settings(
        home=home,
        s3_endpoint=s3.endpoint,
        s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key,
        s3_bucket=s3.bucket,
    )
    return BuilderHandlers(settings)


async def _built(handlers: BuilderHandlers, event: events.DepsResolved) -> events.EnvBuilt:
    envelope = Signer("builder", SigningKey.generate()).seal(event, aggregate_id="sbx-a").envelope
    (out,) = await handlers.on_resolved(envelope, event)
    assert isinstance(out, events.EnvBuilt), out
    return out


def _builds(outcome: str) -> float:
    count = REGISTRY.get_sample_value("dsec_build_seconds_count", {"outcome": outcome})
    return count or 0.0


async def test_env_archive_is_built_once_and_reused_by_the_next_spec_with_the_same_lock(
    tmp_path: Path, s3: Any, index: WheelIndex
) -> None:
    resolved = _resolved(index)
    before = {o: _builds(o) for o in ("built", "reused")}
    first_builder = _handlers(tmp_path / "replica-a", s3)
    other_builder = _handlers(tmp_path / "replica-b", s3)
    try:
        first = await _built(first_builder, resolved)
        hits = sum(index.hits.values())
        again = await _built(first_builder, resolved)
        elsewhere = await _built(other_builder, resolved)  # another replica, same cluster
    finally:
        await first_builder.close()
        await other_builder.close()

    assert not first.reused
    assert first.object_key == env_archive_key(first.lock_hash)
    assert first.model_dump().keys().isdisjoint({"location", "node_id"})  # env.built 2.0
    stored = s3.client().get_object(s3.bucket, first.object_key).read()
    assert blake3.blake3(stored).hexdigest() == first.digest
    assert first.size_bytes == len(stored) and first.unpacked_bytes > 0
    for reuse in (again, elsewhere):
        assert reuse.reused
        assert (reuse.object_key, reuse.digest, reuse.size_bytes, reuse.unpacked_bytes) == (
            first.object_key,
            first.digest,
            first.size_bytes,
            first.unpacked_bytes,
        )
    assert sum(index.hits.values()) == hits  # nothing fetched, nothing built again
    # dsec_build_seconds: one build, two reuses, each timed under its outcome
    assert {o: _builds(o) - n for o, n in before.items()} == {"built": 1, "reused": 2}
    assert not (tmp_path / "replica-b" / "builder" / "envs" / first.lock_hash).exists()
    # the builder works under its own root only; the node agent's envs/ stays untouched
    assert not (tmp_path / "replica-a" / "envs").exists()
    assert (tmp_path / "replica-a" / "builder" / "envs" / first.lock_hash).is_dir()


async def test_an_archive_replaced_in_the_store_is_not_vouched_for_by_its_builder(
    tmp_path: Path, s3: Any, index: WheelIndex
) -> None:
    resolved = _resolved(index)
    handlers = _handlers(tmp_path / "replica-a", s3)
    try:
        first = await _built(handlers, resolved)
        forged = b"not the environment"
        s3.client().put_object(
            s3.bucket,
            first.object_key,
            io.BytesIO(forged),
            len(forged),
            metadata={"blake3": blake3.blake3(forged).hexdigest(), "unpacked-bytes": "1"},
        )
        again = await _built(handlers, resolved)
    finally:
        await handlers.close()

    assert not again.reused and again.digest == first.digest  # packed and stored again
    stored = s3.client().get_object(s3.bucket, first.object_key).read()
    assert blake3.blake3(stored).hexdigest() == first.digest
