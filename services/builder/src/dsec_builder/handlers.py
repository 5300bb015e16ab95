"""Bus handlers of the builder.

``spec.validated`` → resolve → ``deps.resolved`` | ``deps.conflict``;
``deps.resolved`` → build the environment on this node → ``env.built``.

A resolver without a verdict (index unreachable) or a build that cannot complete raises: the
runtime retries with backoff and, after the last attempt, publishes ``sandbox.failed`` with the
reason (for a missing artifact: which ones).
"""

from __future__ import annotations

from collections.abc import Sequence

from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.settings import Settings
from dsec_core.spec.plan import EnforcementPlan

from dsec_builder.builder import EnvironmentBuilder
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


class BuilderHandlers:
    """Resolution and environment builds for one node."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.resolver = Resolver.from_settings(settings)
        self.builder = EnvironmentBuilder.from_settings(settings)

    async def close(self) -> None:
        """Release the builder's connections."""
        await self.builder.close()

    async def on_validated(
        self, envelope: Envelope, event: events.SpecValidated
    ) -> Sequence[events.Payload]:
        """Resolve the plan's dependencies before anything is built."""
        outcome = await self.resolver.resolve(requirements_of(event.plan))
        if isinstance(outcome, Conflict):
            return [conflict_event(outcome)]
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
        """Build (or reuse) the environment of the lock on this node."""
        built = await self.builder.build(lock_of(event))
        return [
            events.EnvBuilt(
                lock_hash=built.lock_hash,
                fingerprint=built.fingerprint,
                location=str(built.path),
                node_id=self.settings.node_id,
                reused=built.reused,
                timings_ms={k: round(v * 1000, 2) for k, v in built.timings.model_dump().items()},
                bytes_by_tier=built.bytes_from.model_dump(),
                integrity_failures=[f.describe() for f in built.integrity_failures],
            )
        ]
