"""Errors the builder raises; each message names the object at fault and what would be valid."""

from __future__ import annotations

from collections.abc import Sequence

from dsec_builder.models import IntegrityFailure, MissingArtifact


class BuilderError(Exception):
    """Base class of every builder error."""


class ResolverUnavailableError(BuilderError):
    """The resolver could not run to a verdict (index unreachable, uv crashed, timed out).

    Unlike a conflict this says nothing about the spec: retry, then report a failure.
    """


class MissingArtifactsError(BuilderError):
    """No cache tier nor the package index could supply some artifacts of a lock.

    Attributes:
        missing: The artifacts that could not be obtained, with the reason for each.
        integrity_failures: Artifacts caught with a wrong sha256 during the attempt.
    """

    def __init__(
        self,
        lock_hash: str,
        missing: Sequence[MissingArtifact],
        integrity_failures: Sequence[IntegrityFailure] = (),
    ) -> None:
        self.lock_hash = lock_hash
        self.missing = tuple(missing)
        self.integrity_failures = tuple(integrity_failures)
        listed = "; ".join(
            f"{m.package} ({m.filename}, sha256 {m.sha256[:12]}…): {m.reason}" for m in self.missing
        )
        super().__init__(
            f"cannot build environment {lock_hash[:16]}: {len(self.missing)} artifact(s) "
            f"unavailable from the node cache, the cluster cache and the package index: {listed}"
        )


class InstallError(BuilderError):
    """The installer rejected verified artifacts; nothing was left in the environment store."""
