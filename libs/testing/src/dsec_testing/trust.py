"""Certified producers for tests: a root key, keys it certifies, their registrations.

Tests that publish events a service must act on sign them as a real producer would: with a key
the stack's operator root certified (``home/trust/root.key``, created by the stack fixture).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
from dsec_core import events, identity
from dsec_core.bus import EventPublisher
from dsec_core.envelope import Envelope
from dsec_core.events import KeyRegistered
from dsec_core.identity import Certificate, Role
from dsec_core.signing import Signer
from dsec_core.spec import compile_plan, load_spec
from nacl.signing import SigningKey
from nats.js import JetStreamContext


@dataclass(frozen=True)
class Producer:
    """A signer with its certificate."""

    signer: Signer
    cert: Certificate

    def registration(self) -> bytes:
        """The wire bytes of this key's ``audit.key_registered`` (first in its chain)."""
        reg = KeyRegistered(
            producer=self.signer.producer,
            key_id=self.signer.key_id,
            public_key=self.signer.public_raw.hex(),
            certificate=self.cert.model_dump(mode="json"),
        )
        return self.signer.seal(reg, aggregate_id=self.signer.key_id, tenant="system").wire


def archive_signer(home: Path) -> Any:
    """The operator's signer of event-archive manifests on the stack of ``home`` (a fresh key
    its root certifies, role ``operator``)."""
    from dsec_core.eventarchive import ManifestSigner

    root = stack_root(home)
    key = SigningKey.generate()
    cert = identity.issue(root, bytes(key.verify_key), subject="operator", role="operator")
    return ManifestSigner(key, cert, bytes(root.verify_key))


def operator_cli_home(home: Path, cli_home: Path) -> Path:
    """``cli_home`` holding the root key of the stack of ``home``: the CLI there is the operator
    (as on the machine of ``dsec up``), e.g. to sign the archive's manifest."""
    paths = identity.TrustPaths(cli_home)
    paths.root_key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths.root_key.write_bytes(bytes(stack_root(home)))
    paths.root_key.chmod(0o600)
    return cli_home


def certified(
    root: SigningKey,
    role: Role,
    *,
    subject: str | None = None,
    tenant: str | None = None,
    node_id: str | None = None,
    acts_for: str | None = None,
) -> Producer:
    """A fresh key certified by ``root`` for ``role`` (users: tenant ``default`` unless given)."""
    key = SigningKey.generate()
    if role == "user":
        tenant = tenant or "default"
    name = subject or (
        f"user-{tenant}-{key.verify_key.encode().hex()[:6]}" if role == "user" else role
    )
    cert = identity.issue(
        root, bytes(key.verify_key), subject=name, role=role, tenant=tenant, node_id=node_id
    )
    # ``acts_for``: the tenant a service's events belong to when the test gives no cause.
    return Producer(Signer(name, key, tenant=acts_for or tenant or "system"), cert)


def stack_root(home: Path) -> SigningKey:
    """The operator root key of a stack home (created when missing, as ``dsec up`` does)."""
    return identity.ensure_root(identity.TrustPaths(home))


async def publisher(
    js: JetStreamContext,
    home: Path,
    role: Role = "user",
    *,
    tenant: str | None = None,
    subject: str | None = None,
    node_id: str | None = None,
    acts_for: str | None = None,
) -> EventPublisher:
    """A publisher certified by the stack's root, its key registered in the log."""
    producer = certified(
        stack_root(home),
        role,
        tenant=tenant,
        subject=subject,
        node_id=node_id,
        acts_for=acts_for,
    )
    pub = EventPublisher(js, producer.signer, certificate=producer.cert)
    await pub.register_key()
    return pub


ENV_BUILT = events.EnvBuilt(
    lock_hash="l",
    fingerprint="f",
    object_key="envs/l.tar.zst",
    digest="d",
    size_bytes=1,
    reused=True,
)
"""The ``env.built`` of an environment every test node already has (an empty lock)."""


@dataclass(frozen=True)
class Pipeline:
    """One certified publisher per producer of a sandbox's lifecycle (tenant ``default``)."""

    user: EventPublisher
    policy: EventPublisher
    builder: EventPublisher
    nodeagent: EventPublisher
    scheduler: EventPublisher

    async def resolved(self, spec_text: str, sid: str, filename: str = "dsec.yaml") -> Envelope:
        """Publish what the user, policy and builder publish for ``spec_text`` up to
        ``deps.resolved`` (the plan compiled from the spec, an empty lock); returns that
        ``deps.resolved``, the cause of the sandbox's ``env.built``."""
        loaded = load_spec(spec_text, filename)
        assert loaded.spec is not None, [e.format() for e in loaded.errors]
        plan = compile_plan(loaded.spec, source=loaded.source).model_dump(mode="json")
        sub = await self.user.publish(
            events.SpecSubmitted(spec_yaml=spec_text, filename=filename), aggregate_id=sid
        )
        val = await self.policy.publish(
            events.SpecValidated(
                name=loaded.spec.name,
                spec_digest=blake3.blake3(spec_text.encode()).hexdigest(),
                plan=plan,
            ),
            aggregate_id=sid,
            causation=sub.envelope,
        )
        res = await self.builder.publish(
            events.DepsResolved(lock=[], lock_hash="l", python="3.11", platform="x", resolve_ms=0),
            aggregate_id=sid,
            causation=val.envelope,
        )
        return res.envelope

    async def built(self, spec_text: str, sid: str, filename: str = "dsec.yaml") -> str:
        """:meth:`resolved`, then the builder's ``env.built`` (the scheduler places on it);
        returns ``sid``."""
        cause = await self.resolved(spec_text, sid, filename)
        await self.builder.publish(ENV_BUILT, aggregate_id=sid, causation=cause)
        return sid


async def pipeline(js: JetStreamContext, home: Path, node_id: str = "n1") -> Pipeline:
    """Publishers that may emit each lifecycle event, as the real services would."""
    tag = SigningKey.generate().verify_key.encode().hex()[:6]
    return Pipeline(
        user=await publisher(js, home, "user", subject=f"user-{tag}"),
        policy=await publisher(js, home, "policy", acts_for="default"),
        builder=await publisher(js, home, "builder", acts_for="default"),
        nodeagent=await publisher(js, home, "nodeagent", node_id=node_id, acts_for="default"),
        scheduler=await publisher(js, home, "scheduler", acts_for="default"),
    )
