"""Pure decisions of the builder: no I/O, no clock, no subprocesses.

- hashing: the lock hash (an environment's key) and the dependency fingerprint;
- reading a resolver's lock (PEP 751 ``pylock.toml``) into the artifacts for one target;
- turning the resolver's derivation into plain words and finding the requirements it involves;
- which relaxed constraints to probe for alternatives, and how to phrase the one that resolves;
- matching a lock against curated combinations that resolve but break at run time.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import blake3
from packaging.markers import InvalidMarker, Marker
from packaging.specifiers import InvalidSpecifier, Specifier, SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, ValidationError

from dsec_builder.models import (
    KnownBadHit,
    Lock,
    LockedPackage,
    Requirement,
    Target,
    artifact_filename,
)

# Bumped when the canonical form changes, so old and new hashes never collide.
LOCK_FORMAT = 1


class LockFormatError(ValueError):
    """The resolver's lock could not be read, or has no installable artifact for a package."""


# --------------------------------------------------------------------------- hashing


def lock_hash(lock: Lock) -> str:
    """BLAKE3 of the canonical lock: the key of the environment it builds.

    URLs are left out on purpose: the same bytes from a mirror build the same environment.
    """
    body = {
        "format": LOCK_FORMAT,
        "target": {"python": lock.target.python_version, "platform": lock.target.platform},
        "packages": sorted(
            [canonicalize_name(p.name), p.version, p.sha256, p.filename] for p in lock.packages
        ),
    }
    canonical = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    return blake3.blake3(canonical).hexdigest()


def fingerprint(packages: Iterable[LockedPackage]) -> str:
    """Stable hash of the sorted ``name==version sha256`` lines of a set of packages."""
    lines = sorted(f"{canonicalize_name(p.name)}=={p.version} {p.sha256}" for p in packages)
    return blake3.blake3("\n".join(lines).encode()).hexdigest()


# --------------------------------------------------------------------------- lock reading


def target_tags(target: Target) -> list[Tag]:
    """Wheel tags the target accepts, most preferred first (as pip would order them)."""
    major, minor = (int(part) for part in target.python_version.split("."))
    platforms: list[str] = []
    for glibc in range(target.glibc_minor, 4, -1):
        platforms.append(f"manylinux_2_{glibc}_x86_64")
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}.get(glibc)
        if legacy:
            platforms.append(f"{legacy}_x86_64")
    interpreter = f"cp{major}{minor}"
    tags = list(cpython_tags((major, minor), abis=[interpreter], platforms=platforms))
    tags += compatible_tags((major, minor), interpreter=interpreter, platforms=platforms)
    return tags


def _marker_environment(target: Target) -> dict[str, str]:
    version = target.python_version
    return {
        "implementation_name": "cpython",
        "implementation_version": f"{version}.0",
        "os_name": "posix",
        "platform_machine": "x86_64",
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": f"{version}.0",
        "python_version": version,
        "sys_platform": "linux",
    }


def _artifact(pkg_name: str, version: str, entry: Mapping[str, Any], kind: str) -> LockedPackage:
    url = entry.get("url")
    sha = (entry.get("hashes") or {}).get("sha256")
    if not isinstance(url, str) or not isinstance(sha, str):
        raise LockFormatError(f"{pkg_name}=={version}: {kind} without url or sha256 hash")
    return LockedPackage.from_source(pkg_name, version, sha, url, entry.get("size"))


def select_artifact(
    name: str,
    version: str,
    wheels: Sequence[Mapping[str, Any]],
    sdist: Mapping[str, Any] | None,
    tags: Sequence[Tag],
) -> LockedPackage:
    """Pick the most preferred wheel for the target's tags, else the source distribution.

    Raises:
        LockFormatError: neither a compatible wheel nor a source distribution exists.
    """
    rank = {tag: index for index, tag in enumerate(tags)}
    best: tuple[int, Mapping[str, Any]] | None = None
    for wheel in wheels:
        try:
            wheel_tags = parse_wheel_filename(artifact_filename(str(wheel.get("url", ""))))[3]
        except InvalidWheelFilename:
            continue
        score = min((rank[t] for t in wheel_tags if t in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, wheel)
    if best is not None:
        return _artifact(name, version, best[1], "wheel")
    if sdist:
        return _artifact(name, version, sdist, "sdist")
    raise LockFormatError(f"{name}=={version}: no wheel for this platform and no source archive")


def parse_pylock(text: str, target: Target) -> Lock:
    """Read a PEP 751 lock written by ``uv pip compile --format pylock.toml`` for ``target``.

    Raises:
        LockFormatError: the text is not a lock, or a package has no usable artifact.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LockFormatError(f"resolver wrote an unreadable lock: {exc}") from None
    tags = target_tags(target)
    environment = _marker_environment(target)
    packages: list[LockedPackage] = []
    for entry in data.get("packages", []):
        name, version = entry.get("name"), entry.get("version")
        if not isinstance(name, str) or not isinstance(version, str):
            raise LockFormatError(f"lock entry without name or version: {entry!r}")
        marker = entry.get("marker")
        try:
            if marker and not Marker(marker).evaluate(environment):
                continue
        except InvalidMarker as exc:
            raise LockFormatError(f"{name}=={version}: bad marker {marker!r}: {exc}") from None
        packages.append(
            select_artifact(name, version, entry.get("wheels", []), entry.get("sdist"), tags)
        )
    return Lock(target=target, packages=tuple(sorted(packages, key=lambda p: p.name)))


def requirements_text(requirements: Iterable[Requirement]) -> str:
    """The requirements in ``requirements.txt`` form, one per line."""
    return "".join(f"{r}\n" for r in requirements)


_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/\s@]+@", re.IGNORECASE)


def redact_text(text: str) -> str:
    """Drop ``user:password@`` from every URL in a message (resolver or installer output)."""
    return _USERINFO.sub(r"\1***@", text)


def redact_url(url: str) -> str:
    """Drop user:password from a URL so index credentials never reach events or logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=f"***@{netloc}"))


# --------------------------------------------------------------------------- conflicts

_DECORATION = re.compile(r"^\s*(?:[×╰─▶|]+\s*)+")
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DEPENDS = re.compile(r"(\S+) depends? on (\S+)")
_NO_VERSION = re.compile(r"there is no version of (\S+)")
_NOT_FOUND = re.compile(r"(\S+) was not found in the package registry")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def clean_resolver_output(stderr: str) -> str:
    """The resolver's derivation as plain text: no banner, no box drawing, one line per step."""
    lines: list[str] = []
    for raw in stderr.splitlines():
        line = _DECORATION.sub("", raw).strip()
        if not line or line.startswith(("error: No solution found", "No solution found")):
            continue
        lines.append(line.removeprefix("cause:").strip())
    return "\n".join(lines)


def _strip(token: str) -> str:
    return token.rstrip(",.;:")


def _key_of(token: str) -> str | None:
    match = _NAME.match(token)
    return canonicalize_name(match.group(0)) if match else None


def summarize_conflict(output: str, requirements: Sequence[Requirement]) -> str:
    """One or two plain sentences saying which requirement clashes with which.

    ``output`` is :func:`clean_resolver_output`'s text. Falls back to its first sentence.
    """
    direct = {r.key: r for r in requirements}
    flat = " ".join(output.split())
    sentences: list[str] = []
    for who, dep in _DEPENDS.findall(flat):
        wanted = direct.get(_key_of(dep) or "")
        if wanted is not None and wanted.specifier:
            sentences.append(
                f"{_strip(who)} requires {_strip(dep)}, but the spec asks for {wanted}."
            )
    sentences += [f"No released version matches {_strip(x)}." for x in _NO_VERSION.findall(flat)]
    sentences += [f"{_strip(x)} is not in the package index." for x in _NOT_FOUND.findall(flat)]
    unique = list(dict.fromkeys(sentences))
    if unique:
        return " ".join(unique)
    first = flat.split(". ")[0].strip()
    return first if first.endswith(".") else f"{first}."


def conflicting_requirements(output: str, requirements: Sequence[Requirement]) -> list[Requirement]:
    """The user's requirements the resolver's derivation names, in order of mention."""
    direct = {r.key: r for r in requirements}
    seen: dict[str, Requirement] = {}
    for token in _TOKEN.findall(output):
        key = canonicalize_name(token)
        if key in direct and key not in seen:
            seen[key] = direct[key]
    return list(seen.values())


# --------------------------------------------------------------------------- alternatives


@dataclass(frozen=True)
class Relaxation:
    """One probe for an alternative: the user's requirement with its range moved one way.

    Attributes:
        original: The user's requirement.
        direction: ``newer`` probes versions above its range, ``older`` below.
        probe: The requirement to resolve with instead.
        lowest: Resolve direct dependencies lowest-first, so ``newer`` finds the *nearest*
            newer version rather than the latest.
    """

    original: Requirement
    direction: Literal["newer", "older"]
    probe: Requirement
    lowest: bool


@dataclass(frozen=True)
class _Bound:
    version: Version
    inclusive: bool


def _next_release(release: tuple[int, ...], position: int) -> Version:
    """The release after ``release`` at ``position`` (0 major, 1 minor): 4.43.2 -> 4.44."""
    parts = list(release[: position + 1]) + [0] * max(0, position + 1 - len(release))
    parts[position] += 1
    return Version(".".join(str(p) for p in parts))


def _bounds(spec: Specifier) -> tuple[_Bound | None, _Bound | None]:
    op, text = spec.operator, spec.version
    if op == "==" and text.endswith(".*"):
        base = Version(text[:-2])
        return _Bound(base, True), _Bound(_next_release(base.release, len(base.release) - 1), False)
    version = Version(text)
    if op in ("==", "==="):
        return _Bound(version, True), _Bound(version, True)
    if op == "~=":
        ceiling = _next_release(version.release, len(version.release) - 2)
        return _Bound(version, True), _Bound(ceiling, False)
    return {
        ">=": (_Bound(version, True), None),
        ">": (_Bound(version, False), None),
        "<": (None, _Bound(version, False)),
        "<=": (None, _Bound(version, True)),
    }.get(op, (None, None))


def _range(specifier: str) -> tuple[_Bound | None, _Bound | None]:
    lower: _Bound | None = None
    upper: _Bound | None = None
    for spec in SpecifierSet(specifier):
        low, high = _bounds(spec)
        if low and (lower is None or low.version > lower.version):
            lower = low
        if high and (upper is None or high.version < upper.version):
            upper = high
    return lower, upper


def is_pin(requirement: Requirement) -> bool:
    """True when the requirement allows exactly one version (``==1.2.3``)."""
    specs = [s for s in SpecifierSet(requirement.specifier) if s.operator != "!="]
    return len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version


def relaxations(requirement: Requirement) -> list[Relaxation]:
    """Probes for the nearest versions outside ``requirement``'s range: newer, then older."""
    try:
        lower, upper = _range(requirement.specifier)
    except (InvalidSpecifier, InvalidVersion):
        return []
    probes: list[Relaxation] = []
    if upper is not None:
        op = ">" if upper.inclusive else ">="
        probe = requirement.model_copy(update={"specifier": f"{op}{upper.version}"})
        probes.append(Relaxation(requirement, "newer", probe, lowest=True))
    if lower is not None:
        op = "<=" if not lower.inclusive else "<"
        probe = requirement.model_copy(update={"specifier": f"{op}{lower.version}"})
        probes.append(Relaxation(requirement, "older", probe, lowest=False))
    return probes


def propose(relaxation: Relaxation, found: str) -> Requirement:
    """The requirement to offer once a probe resolved with version ``found``.

    A pin stays a pin (``vllm==0.5.0.post1``); a range becomes the nearest minor series above
    (``transformers>=4.43.2,<4.44``) or a ceiling below (``transformers<=4.39.3``). Every
    proposal contains ``found``, so the probe's lock proves it resolves.
    """
    original = relaxation.original
    if is_pin(original):
        specifier = f"=={found}"
    elif relaxation.direction == "newer":
        version = Version(found)
        specifier = f">={found},<{_next_release(version.release, min(1, len(version.release)))}"
    else:
        specifier = f"<={found}"
    return original.model_copy(update={"specifier": specifier})


def alternative_reason(relaxation: Relaxation, found: str) -> str:
    """Why an alternative is offered, in plain words."""
    name = relaxation.original.name
    return (
        f"{name} {found} is the nearest {relaxation.direction} version "
        "that resolves with the rest of the spec"
    )


def with_requirement(requirements: Sequence[Requirement], change: Requirement) -> list[Requirement]:
    """``requirements`` with ``change`` replacing the entry of the same package, else added."""
    replaced = False
    result: list[Requirement] = []
    for requirement in requirements:
        if requirement.key == change.key:
            result.append(change.model_copy(update={"line": requirement.line}))
            replaced = True
        else:
            result.append(requirement)
    if not replaced:
        result.append(change)
    return result


def find_requirement(requirements: Sequence[Requirement], key: str) -> Requirement | None:
    """The user's requirement for a canonical package name, if any."""
    return next((r for r in requirements if r.key == key), None)


# --------------------------------------------------------------------------- known-bad


class KnownBadRule(BaseModel):
    """A combination that resolves but is known to break at run time.

    Attributes:
        id: Stable identifier, shown to users.
        when: Requirements that must *all* match pinned packages of a lock.
        reason: What breaks, in plain words.
        alternatives: Requirements to replace or add instead, tried in order.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    when: tuple[str, ...]
    reason: str
    alternatives: tuple[str, ...]
    source: str | None = None


def parse_known_bad(text: str, origin: str = "known_bad.toml") -> tuple[KnownBadRule, ...]:
    """Read the curated rules (``[[rule]]`` tables).

    Raises:
        ValueError: naming the file and the rule that is malformed.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{origin}: {exc}") from None
    rules: list[KnownBadRule] = []
    for index, raw in enumerate(data.get("rule", [])):
        try:
            rule = KnownBadRule.model_validate(raw)
            for requirement in (*rule.when, *rule.alternatives):
                Requirement.parse(requirement)
        except (ValidationError, ValueError) as exc:
            raise ValueError(f"{origin}: rule #{index + 1} ({raw.get('id')!r}): {exc}") from None
        rules.append(rule)
    return tuple(rules)


def match_known_bad(lock: Lock, rules: Iterable[KnownBadRule]) -> KnownBadHit | None:
    """The first rule whose every ``when`` requirement matches a pinned package of ``lock``."""
    pinned: dict[str, LockedPackage] = {canonicalize_name(p.name): p for p in lock.packages}
    for rule in rules:
        matched: list[str] = []
        for text in rule.when:
            requirement = Requirement.parse(text)
            package = pinned.get(requirement.key)
            spec = SpecifierSet(requirement.specifier)
            if package is None or not spec.contains(package.version, prereleases=True):
                break
            matched.append(f"{package.name}=={package.version}")
        else:
            return KnownBadHit(rule_id=rule.id, reason=rule.reason, matched=tuple(matched))
    return None
