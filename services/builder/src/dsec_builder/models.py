"""Data the builder takes and returns: requirements, targets, locks and results.

Every model is frozen: a lock or a build result is a fact, later mapped 1:1 onto the
``deps.resolved``, ``deps.conflict`` and ``env.built`` events by the service's handlers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from packaging.markers import InvalidMarker, Marker
from packaging.requirements import InvalidRequirement
from packaging.requirements import Requirement as PepRequirement
from packaging.utils import canonicalize_name
from pydantic import BaseModel, ConfigDict, Field, field_validator

_FROZEN = ConfigDict(frozen=True, extra="forbid")

Tier = Literal["local", "s3", "index"]


def artifact_filename(url: str) -> str:
    """The file name an artifact URL ends with (``numpy-2.1.0-cp311-…whl``)."""
    return unquote(urlsplit(url).path.rsplit("/", 1)[-1])


class Requirement(BaseModel):
    """One dependency as the user wrote it (a spec's ``dependencies`` entry).

    Attributes:
        name: The distribution name, optionally with extras (``transformers``, ``httpx[http2]``).
        specifier: A PEP 440 version specifier (``>=4.40.0,<4.42.0``), empty for any version.
        marker: A PEP 508 environment marker (``python_version >= '3.11'``), evaluated for the
            target.
        line: The spec's line number of this entry, so errors can point at the YAML.
    """

    model_config = _FROZEN

    name: str
    specifier: str = ""
    marker: str | None = None
    line: int | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        try:
            parsed = PepRequirement(value)
        except InvalidRequirement as exc:
            raise ValueError(f"invalid package name {value!r}: {exc}") from None
        if parsed.specifier or parsed.marker or parsed.url:
            raise ValueError(f"package {value!r} must be a bare name; put the version in `version`")
        return value

    @field_validator("specifier")
    @classmethod
    def _valid_specifier(cls, value: str) -> str:
        value = value.strip()
        try:
            PepRequirement(f"x{value}")
        except InvalidRequirement:
            raise ValueError(
                f"invalid version specifier {value!r}: "
                "expected PEP 440 like '>=1.2,<2' or '==1.4.1'"
            ) from None
        return value

    @field_validator("marker")
    @classmethod
    def _valid_marker(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return str(Marker(value))
        except InvalidMarker as exc:
            raise ValueError(f"invalid environment marker {value!r}: {exc}") from None

    @classmethod
    def parse(cls, text: str, line: int | None = None) -> Requirement:
        """Parse a PEP 508 requirement (``vllm==0.6.1``, ``rich[jupyter]>=13; os_name=='posix'``).

        Raises:
            ValueError: ``text`` is not a PEP 508 requirement, or names a URL.
        """
        try:
            parsed = PepRequirement(text)
        except InvalidRequirement as exc:
            raise ValueError(f"invalid requirement {text!r}: {exc}") from None
        if parsed.url:
            raise ValueError(f"requirement {text!r}: direct URLs are not supported, use a version")
        extras = f"[{','.join(sorted(parsed.extras))}]" if parsed.extras else ""
        marker = str(parsed.marker) if parsed.marker else None
        return cls(
            name=parsed.name + extras, specifier=str(parsed.specifier), marker=marker, line=line
        )

    @property
    def key(self) -> str:
        """The canonical (PEP 503 normalized) name, for comparisons."""
        return canonicalize_name(PepRequirement(self.name).name)

    def __str__(self) -> str:
        marker = f"; {self.marker}" if self.marker else ""
        return f"{self.name}{self.specifier}{marker}"


class Target(BaseModel):
    """The interpreter and platform an environment is resolved and built for."""

    model_config = _FROZEN

    python_version: str = Field(default="3.11", pattern=r"^3\.\d+$")
    platform: str = Field(
        default="x86_64-manylinux_2_28",
        pattern=r"^x86_64-manylinux_2_\d+$",
        description="uv's --python-platform: manylinux x86_64 with the glibc floor of the nodes",
    )

    @property
    def glibc_minor(self) -> int:
        """The glibc minor version (28 for manylinux_2_28)."""
        return int(self.platform.rsplit("_", 1)[1])


class LockedPackage(BaseModel):
    """One pinned artifact of a lock: what to fetch, from where, and its content hash."""

    model_config = _FROZEN

    name: str
    version: str
    filename: str
    url: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int | None = None
    kind: Literal["wheel", "sdist"] = "wheel"

    @classmethod
    def from_source(
        cls, name: str, version: str, sha256: str, url: str, size: int | None = None
    ) -> LockedPackage:
        """Rebuild an entry from (name, version, sha256, source URL), e.g. from an event.

        The filename and kind come from the URL, exactly as when the lock was read, so the
        lock hash is the same on both sides of the bus.
        """
        filename = artifact_filename(url)
        kind: Literal["wheel", "sdist"] = "wheel" if filename.endswith(".whl") else "sdist"
        return cls(
            name=name,
            version=version,
            filename=filename,
            url=url,
            sha256=sha256.lower(),
            size=size,
            kind=kind,
        )


class Lock(BaseModel):
    """A complete, pinned set of artifacts for one target."""

    model_config = _FROZEN

    target: Target
    packages: tuple[LockedPackage, ...]


class Alternative(BaseModel):
    """A concrete change to the spec that resolves (proved by a resolver run).

    Attributes:
        requirement: The requirement to use instead (``transformers>=4.43.2,<4.44``).
        replaces: The user's requirement it replaces, or ``None`` when it is added.
        line: The spec line of the replaced requirement, when known.
        resolved_version: The version of the package the proving resolution picked.
        lock_hash: Hash of the lock that proved it resolves.
        reason: Why this is offered, in plain words.
    """

    model_config = _FROZEN

    requirement: str
    replaces: str | None
    line: int | None = None
    resolved_version: str
    lock_hash: str
    reason: str


class KnownBadHit(BaseModel):
    """A resolved lock that matches a curated combination known to break at run time."""

    model_config = _FROZEN

    rule_id: str
    reason: str
    matched: tuple[str, ...] = Field(description="Pinned packages that matched, name==version")


class Resolved(BaseModel):
    """Resolution succeeded: the lock for ``deps.resolved``."""

    model_config = _FROZEN

    status: Literal["resolved"] = "resolved"
    lock: Lock
    lock_hash: str
    fingerprint: str
    duration_s: float


class Conflict(BaseModel):
    """Resolution is blocked: the explanation and alternatives for ``deps.conflict``.

    Attributes:
        kind: ``unsatisfiable`` (no lock exists) or ``known-bad`` (a lock exists but is curated
            as breaking at run time).
        summary: The reason in plain words.
        resolver_output: The resolver's own derivation, cleaned of terminal decoration.
        packages: The user's requirements involved in the conflict.
        alternatives: Changes that resolve, nearest first; each one proved by a resolution.
        known_bad: The matched rule, for ``known-bad``.
    """

    model_config = _FROZEN

    status: Literal["conflict"] = "conflict"
    kind: Literal["unsatisfiable", "known-bad"]
    summary: str
    resolver_output: str
    packages: tuple[str, ...]
    alternatives: tuple[Alternative, ...]
    known_bad: KnownBadHit | None = None
    duration_s: float


class IntegrityFailure(BaseModel):
    """An artifact whose bytes did not match the lock's sha256; it was never installed."""

    model_config = _FROZEN

    package: str = Field(description="name==version")
    filename: str
    tier: Tier
    expected_sha256: str
    actual_sha256: str
    action: str = Field(description="What the builder did about it, in plain words")

    def describe(self) -> str:
        """One line for events and logs."""
        return (
            f"{self.package} ({self.filename}) from the {self.tier} tier: sha256 "
            f"{self.actual_sha256[:16]}… instead of {self.expected_sha256[:16]}…; {self.action}"
        )


class TierBytes(BaseModel):
    """Bytes of artifacts taken from each cache tier during one build."""

    model_config = _FROZEN

    local: int = 0
    s3: int = 0
    index: int = 0


class BuildTimings(BaseModel):
    """Seconds spent in each build phase."""

    model_config = _FROZEN

    fetch_s: float = 0.0
    install_s: float = 0.0
    total_s: float = 0.0


class BuiltEnv(BaseModel):
    """An environment ready for a sandbox: the payload of ``env.built``.

    Attributes:
        lock_hash: The environment's key (BLAKE3 of the canonical lock).
        fingerprint: Stable hash of sorted name/version/sha256 (used by snapshots).
        path: Directory to put on ``PYTHONPATH`` (the environment's site-packages).
        reused: True when an identical lock's environment already existed.
        timings: Phase timings of this call.
        bytes_from: Artifact bytes taken from each cache tier.
        integrity_failures: Artifacts caught with a wrong hash (refetched, never installed).
        packages: Number of packages in the environment.
    """

    model_config = _FROZEN

    lock_hash: str
    fingerprint: str
    path: Path
    reused: bool
    timings: BuildTimings
    bytes_from: TierBytes
    integrity_failures: tuple[IntegrityFailure, ...] = ()
    packages: int


class MissingArtifact(BaseModel):
    """An artifact no tier could supply."""

    model_config = _FROZEN

    package: str = Field(description="name==version")
    filename: str
    sha256: str
    reason: str


class EnvironmentInfo(BaseModel):
    """One stored environment, as ``dsec env ls`` shows it."""

    model_config = _FROZEN

    lock_hash: str
    fingerprint: str
    path: Path
    packages: int
    size_bytes: int
    created_at: float
    last_used_at: float
