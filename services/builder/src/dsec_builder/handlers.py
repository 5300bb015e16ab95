"""Bus handlers of the builder.

``spec.validated`` → resolve → ``deps.resolved`` | ``deps.conflict``;
``deps.resolved`` → the lock's environment archive in the object store (reused when it exists,
else built, packed and stored once for the cluster) → ``env.built``.

A resolver without a verdict (index unreachable) or a build that cannot complete raises: the
runtime retries with backoff and, after the last attempt, publishes ``sandbox.failed`` with the
reason (for a missing artifact: which ones).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.layout import NodeLayout
from dsec_core.objectstore import client as s3_client
from dsec_core.settings import Settings
from dsec_core.spec.plan import EnforcementPlan
from dsec_core.threads import to_thread_to_the_end

from dsec_builder import metrics
from dsec_builder.adapters.archives import EnvArchives, StoredArchive
from dsec_builder.builder import EnvironmentBuilder
from dsec_builder.domain import fingerprint, lock_hash
from dsec_builder.models import Conflict, Lock, LockedPackage, Requirement, Target
from dsec_builder.resolver import Resolver


def requirements_of(plan: EnforcementPlan) -> list[Requirement]:
    """The builder's requirements from a compiled plan's ``dependencies``."""
    return [
        Requirement(
            name=f"{dep.name}[{','.join(dep.extras)}]" if dep.extras else dep.name,
            specifier=dep.specifier,
            marker=dep.marker,
        )
        for dep in plan.dependencies
    ]


def conflict_event(conflict: Conflict) -> events.DepsConflict:
    """``deps.conflict`` with the explanation in plain words and verified alternatives."""
    explanation = conflict.summary
    if conflict.known_bad is not None:
        explanation += f" [known-bad rule {conflict.known_bad.rule_id}]"
    return events.DepsConflict(
        explanation=f"{explanation}\n{conflict.resolver_output}".strip(),
        conflicting=list(conflict.packages),
        alternatives=[
            events.Alternative(
                requirement=a.replaces or "(add)", suggestion=a.requirement, verified=True
            )
            for a in conflict.alternatives
        ],
        known_bad=conflict.kind == "known-bad",
    )


def lock_of(event: events.DepsResolved) -> Lock:
    """Rebuild the builder's lock from ``deps.resolved`` (same lock hash on both sides)."""
    return Lock(
        target=Target(python_version=event.python, platform=event.platform),
        packages=tuple(
            LockedPackage.from_source(p.name, p.version, p.sha256, p.source) for p in event.lock
        ),
    )


log = logging.getLogger(__name__)
LEFTOVER_AGE_S = 3600.0
"""A download or archive in the builder's work directories untouched this long is a killed
build's leftover (a download is limited to 600 s)."""


class BuilderHandlers:
    """Resolution and environment builds for one node."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.resolver = Resolver.from_settings(settings)
        s3 = s3_client(settings) if settings.endpoint("s3_endpoint") else None
        self.builder = EnvironmentBuilder.from_settings(settings, s3=s3)
        self.archives = (
            EnvArchives(s3, settings.s3_bucket, NodeLayout.of(settings.home).builder / "archives")
            if s3 is not None
            else None
        )

    async def sweep(self) -> None:
        """At start: remove the downloads and archives a killed builder left half written
        (older than :data:`LEFTOVER_AGE_S`: a younger one may be another builder's, at work)."""

        def sweep() -> int:
            removed = self.builder.cache.sweep(LEFTOVER_AGE_S)
            return removed + (self.archives.sweep(LEFTOVER_AGE_S) if self.archives else 0)

        removed = await asyncio.to_thread(sweep)
        if removed:
            log.info("removed %d half-written downloads or archives of killed builds", removed)

    async def close(self) -> None:
        """Release the builder's connections."""
        await self.builder.close()

    async def on_validated(
        self, envelope: Envelope, event: events.SpecValidated
    ) -> Sequence[events.Payload]:
        """Resolve the plan's dependencies before anything is built."""
        started = time.monotonic()
        outcome = await self.resolver.resolve(requirements_of(event.plan))
        if isinstance(outcome, Conflict):
            metrics.RESOLVE_SECONDS.labels("conflict").observe(time.monotonic() - started)
            return [conflict_event(outcome)]
        metrics.RESOLVE_SECONDS.labels("resolved").observe(time.monotonic() - started)
        lock = outcome.lock
        return [
            events.DepsResolved(
                lock=[
                    events.LockedPackage(
                        name=p.name, version=p.version, sha256=p.sha256, source=p.url
                    )
                    for p in lock.packages
                ],
                lock_hash=outcome.lock_hash,
                python=lock.target.python_version,
                platform=lock.target.platform,
                resolve_ms=round(outcome.duration_s * 1000, 1),
            )
        ]

    async def on_resolved(
        self, envelope: Envelope, event: events.DepsResolved
    ) -> Sequence[events.Payload]:
        """The lock's environment archive: reused when stored, else built, packed and stored."""
        if self.archives is None:
            return [
                events.SandboxFailed(
                    stage="builder",
                    reason="no object store: environments reach the nodes through S3 "
                    "(set DSEC_S3_ENDPOINT or run `dsec up`)",
                    failed_event_id=envelope.id,
                )
            ]
        started = time.monotonic()
        lock = lock_of(event)
        key = lock_hash(lock)
        stored = await asyncio.to_thread(self.archives.existing, key)
        if stored is not None:
            metrics.BUILD_SECONDS.labels("reused").observe(time.monotonic() - started)
            timings = {"total": round((time.monotonic() - started) * 1000, 2)}
            return [_env_built(key, event, stored, reused=True, timings_ms=timings)]
        built = await self.builder.build(lock)
        async with self.builder.store.build_lock(key):  # one pack and upload per lock here
            packing = time.monotonic()
            stored = await asyncio.to_thread(self.archives.existing, key)
            if stored is None:
                env_root = self.builder.store.env_dir(key)
                # Under the lock to its end: a cancelled attempt's upload is not raced by the
                # retry's, which takes the lock only once it has ended.
                stored = await to_thread_to_the_end(self.archives.store, key, env_root)
        timings = {k: round(v * 1000, 2) for k, v in built.timings.model_dump().items()}
        timings["pack_store"] = round((time.monotonic() - packing) * 1000, 2)
        timings["total"] = round((time.monotonic() - started) * 1000, 2)
        metrics.BUILD_SECONDS.labels("built").observe(time.monotonic() - started)
        return [
            _env_built(
                key,
                event,
                stored,
                reused=False,
                timings_ms=timings,
                bytes_by_tier=built.bytes_from.model_dump(),
                integrity_failures=[f.describe() for f in built.integrity_failures],
                fingerprint=built.fingerprint,
            )
        ]


def _env_built(
    key: str,
    event: events.DepsResolved,
    stored: StoredArchive,
    *,
    reused: bool,
    timings_ms: dict[str, float],
    bytes_by_tier: dict[str, int] | None = None,
    integrity_failures: list[str] | None = None,
    fingerprint: str | None = None,
) -> events.EnvBuilt:
    return events.EnvBuilt(
        lock_hash=key,
        fingerprint=fingerprint or fingerprint_of(event),
        object_key=stored.object_key,
        digest=stored.digest,
        size_bytes=stored.size_bytes,
        unpacked_bytes=stored.unpacked_bytes,
        reused=reused,
        timings_ms=timings_ms,
        bytes_by_tier=bytes_by_tier or {},
        integrity_failures=integrity_failures or [],
    )


def fingerprint_of(event: events.DepsResolved) -> str:
    """The lock's fingerprint (as :func:`dsec_builder.domain.fingerprint` computes it)."""
    return fingerprint(lock_of(event).packages)
