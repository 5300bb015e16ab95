"""DSec builder: resolve a spec's dependencies before anything is built, explain conflicts with
alternatives that resolve, and build content-addressed environments from hash-verified caches.

Typical use (what the service's handlers do)::

    resolver = Resolver.from_settings(settings)
    outcome = await resolver.resolve(requirements)          # Resolved | Conflict
    if isinstance(outcome, Resolved):
        env = await EnvironmentBuilder.from_settings(settings).build(outcome.lock)  # BuiltEnv
"""

from dsec_builder.builder import EnvironmentBuilder, default_interpreter
from dsec_builder.domain import fingerprint, lock_hash
from dsec_builder.errors import (
    BuilderError,
    InstallError,
    MissingArtifactsError,
    ResolverUnavailableError,
)
from dsec_builder.models import (
    Alternative,
    BuildTimings,
    BuiltEnv,
    Conflict,
    EnvironmentInfo,
    IntegrityFailure,
    KnownBadHit,
    Lock,
    LockedPackage,
    MissingArtifact,
    Requirement,
    Resolved,
    Target,
    TierBytes,
)
from dsec_builder.resolver import Resolver, load_known_bad

__all__ = [
    "Alternative",
    "BuildTimings",
    "BuilderError",
    "BuiltEnv",
    "Conflict",
    "EnvironmentBuilder",
    "EnvironmentInfo",
    "InstallError",
    "IntegrityFailure",
    "KnownBadHit",
    "Lock",
    "LockedPackage",
    "MissingArtifact",
    "MissingArtifactsError",
    "Requirement",
    "Resolved",
    "Resolver",
    "ResolverUnavailableError",
    "Target",
    "TierBytes",
    "default_interpreter",
    "fingerprint",
    "load_known_bad",
    "lock_hash",
]
