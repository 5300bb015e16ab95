"""What the event log says about a sandbox, and the decisions on snapshot requests (no I/O).

The node agent and the snapshot service learn everything about a sandbox from its events: the
spec and compiled plan (``spec.validated``), the environment (``env.built`` +
``deps.resolved``), where its code copy lives (``sandbox.ready.code_dir``), the secrets
injected (``context.injected``: names and digests only) and whether it ended
(``sandbox.exited``). :class:`SandboxFacts` gathers them; the functions below decide who acts
on a request, what a snapshot records and when a request is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgpack
from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.lifecycle import Lifecycle

from dsec_snapstore.manifest import DepsRecord

_P = TypeVar("_P", bound=events.Payload)

SECRET_VALUE_PREFIX = "secret-digest:"
"""A secret env var is recorded by the digest ``context.injected`` published, never its value:
the keyed hash of ``secret-digest:<digest>`` changes exactly when the secret's value does."""

FULL_STATE_REFUSAL = (
    "full-state snapshots (process memory) are not supported: a snapshot records the code, "
    "dependency lock, environment (names and hashes), kernel parameters, GPU layout and audit "
    "segment; request it without --full-state"
)


@dataclass(frozen=True)
class SandboxFacts:
    """The latest event of each kind the snapshot service needs about one sandbox."""

    sandbox_id: str
    submitted: events.SpecSubmitted | None = None
    validated: events.SpecValidated | None = None
    resolved: events.DepsResolved | None = None
    built: events.EnvBuilt | None = None
    ready: events.SandboxReady | None = None
    exited: events.SandboxExited | None = None
    secrets: dict[str, str] = field(default_factory=dict)
    """Secret env var name -> the digest ``context.injected`` recorded (never the value)."""

    @classmethod
    def from_events(cls, sandbox_id: str, envelopes: Iterable[Envelope]) -> SandboxFacts:
        """Fold a sandbox's envelopes (in log order; any subset) into facts."""
        found: dict[str, events.Payload] = {}
        secrets: dict[str, str] = {}
        for env in envelopes:
            payload = env.decoded()
            if isinstance(payload, events.ContextInjected):
                if payload.kind == "secret" and payload.digest:
                    secrets[payload.name] = payload.digest
                continue
            found[env.type] = payload
        return cls(
            sandbox_id=sandbox_id,
            submitted=_as(found.get("spec.submitted"), events.SpecSubmitted),
            validated=_as(found.get("spec.validated"), events.SpecValidated),
            resolved=_as(found.get("deps.resolved"), events.DepsResolved),
            built=_as(found.get("env.built"), events.EnvBuilt),
            ready=_as(found.get("sandbox.ready"), events.SandboxReady),
            exited=_as(found.get("sandbox.exited"), events.SandboxExited),
            secrets=secrets,
        )

    @property
    def running(self) -> bool:
        """True when the sandbox started and has not exited."""
        return self.ready is not None and self.exited is None


def _as(payload: events.Payload | None, model: type[_P]) -> _P | None:
    return payload if isinstance(payload, model) else None


# --- create ---------------------------------------------------------------------------------


def create_refusal(facts: SandboxFacts, request: events.SnapshotRequested) -> str | None:
    """Why a snapshot of this sandbox cannot be taken at all (``None``: it can)."""
    sid = facts.sandbox_id
    if request.full_state:
        return FULL_STATE_REFUSAL
    if facts.submitted is None:
        return f"no sandbox {sid!r} in the event log (see `dsec sandbox list`)"
    if facts.validated is None:
        return f"sandbox {sid} has no validated spec (rejected, or not validated yet)"
    return None


def exclude_patterns(facts: SandboxFacts) -> tuple[str, ...]:
    """The spec's ``include_code.exclude_patterns`` from the compiled plan."""
    assert facts.validated is not None
    return tuple(facts.validated.plan.exclude_patterns)


def env_values(facts: SandboxFacts) -> dict[str, str]:
    """What the snapshot hashes per env var: plain values, and for secrets their digest."""
    assert facts.validated is not None
    plain = {e.name: e.value for e in facts.validated.plan.env}
    secret = {name: SECRET_VALUE_PREFIX + digest for name, digest in facts.secrets.items()}
    return plain | secret


def deps_record(facts: SandboxFacts) -> DepsRecord | None:
    """The environment's fingerprint and lock (``None`` before ``env.built``)."""
    built = facts.built
    if built is None:
        return None
    packages = tuple(facts.resolved.lock) if facts.resolved is not None else ()
    return DepsRecord(fingerprint=built.fingerprint, lock_hash=built.lock_hash, packages=packages)


def audit_segment(records: Sequence[tuple[int, bytes]]) -> bytes:
    """The sandbox's events as recorded: a MessagePack list of ``[stream seq, wire bytes]``.

    The wire bytes are the signed envelopes themselves, so the segment can be verified with
    the producers' keys after decryption; the sequence numbers show gaps.
    """
    packed: bytes = msgpack.packb([[seq, data] for seq, data in records], use_bin_type=True)
    return packed


def snapshot_taken(
    name: str, digest: str, files: int, total: int, uploaded: int
) -> events.SnapshotTaken:
    """The ``snapshot.taken`` event of a stored snapshot."""
    return events.SnapshotTaken(
        snapshot=name,
        manifest_digest=digest,
        files=files,
        bytes_total=total,
        bytes_uploaded=uploaded,
    )


# --- restore --------------------------------------------------------------------------------


def acting_node(lifecycle: Lifecycle, facts: SandboxFacts) -> str | None:
    """The node whose agent acts for the sandbox now (snapshots, rollbacks), ``None`` when it
    runs nowhere (then the snapshot service answers).

    The lifecycle fold decides once the sandbox was scheduled (``sandbox.scheduled`` names the
    node); a sandbox started without the scheduler (a node agent that consumes ``env.built``)
    is owned by the node its ``sandbox.ready`` names until it exits.
    """
    if lifecycle.node_id is not None:
        return lifecycle.node_id if lifecycle.owned_by(lifecycle.node_id) else None
    if facts.running and facts.ready is not None:
        return facts.ready.node_id
    return None


def periodic_prefix(sandbox_id: str) -> str:
    """The name prefix (and ``periodic`` label) of a sandbox's periodic snapshots."""
    return f"auto-{sandbox_id}"


def running_refusal(facts: SandboxFacts, node_id: str) -> str | None:
    """Why the owning node cannot read or rewrite the sandbox's code yet (``None``: it can)."""
    if facts.ready is None:
        return f"sandbox {facts.sandbox_id} is scheduled on {node_id!r} but has not started yet"
    return None


def code_dir_refusal(facts: SandboxFacts, expected: Path) -> str | None:
    """Why the code dir ``sandbox.ready`` reports is not the one to read or rewrite.

    The path comes from an event; only where the node keeps the sandbox's code (``expected``,
    from its :class:`~dsec_core.layout.NodeLayout`) is ever accepted, so a forged
    ``sandbox.ready`` cannot make a node read or rewrite another directory.
    """
    ready = facts.ready
    if ready is None or ready.code_dir is None:
        return None
    if Path(ready.code_dir) != expected:
        return (
            f"sandbox {facts.sandbox_id} reports code dir {ready.code_dir}, which is not where "
            f"this node keeps its code ({expected}): refused"
        )
    return None


def not_running(facts: SandboxFacts, snapshot: str) -> str:
    """Why a sandbox that runs nowhere cannot be rolled back."""
    sid = facts.sandbox_id
    if facts.exited is not None:
        return (
            f"sandbox {sid} has exited ({facts.exited.reason}, exit code "
            f"{facts.exited.exit_code}): start a new one with "
            f"`dsec sandbox run --snapshot {snapshot}`"
        )
    return f"sandbox {sid} is not running (no sandbox.ready in the event log)"


def deps_verdict(
    recorded: DepsRecord | None, built: events.EnvBuilt | None
) -> tuple[bool | None, str]:
    """Whether the running environment is the snapshot's, and what to tell the user if not.

    A rollback rewrites code only: the interpreter and imported packages of a running process
    cannot be swapped under it, so a different environment is reported, never faked.
    """
    if recorded is None:
        return None, "the snapshot records no environment: dependencies were not compared"
    if built is None:
        return None, "the sandbox records no environment: dependencies were not compared"
    if recorded.fingerprint == built.fingerprint:
        return True, ""
    return False, (
        f"dependencies differ (snapshot {recorded.fingerprint[:12]}, running "
        f"{built.fingerprint[:12]}): the code was rolled back, the environment of a running "
        "process cannot be; start from the snapshot with `dsec sandbox run --snapshot` "
        "to get its environment"
    )
