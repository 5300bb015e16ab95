"""Events as the client hands them over: the signed envelope, where the log holds it, whether it
was verified, and its payload as the typed model of :mod:`dsec_core.events`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dsec_core.envelope import Envelope
from dsec_core.events import Payload


@dataclass(frozen=True)
class Event:
    """One event of the log.

    Attributes:
        seq: its position in the ``DSEC_EVENTS`` stream.
        envelope: the signed envelope (:class:`dsec_core.envelope.Envelope`).
        verified: its signature, certificate (from the operator root) and the producer's right
            to publish it were checked. ``False`` only where no trust root is known (then the
            client warns once) or with ``DSec(verify=False)``.
        ignored: for a sandbox's events, why its state fold did not apply it (an event that
            cannot follow the state, e.g. a second ``sandbox.ready``); ``None`` when applied.
    """

    seq: int
    envelope: Envelope
    verified: bool
    ignored: str | None = None

    @property
    def type(self) -> str:
        """The event type, e.g. ``sandbox.ready``."""
        return self.envelope.type

    @property
    def id(self) -> str:
        return self.envelope.id

    @property
    def time(self) -> datetime:
        return self.envelope.time

    @property
    def producer(self) -> str:
        """Who signed it: ``policy``, ``nodeagent-<node>``, ``user-<name>``, ..."""
        return self.envelope.producer

    @property
    def tenant(self) -> str:
        return self.envelope.tenant

    @property
    def aggregate_id(self) -> str:
        """What it is about: a sandbox id (``sbx_...``), a node, a snapshot, a key."""
        return self.envelope.aggregate_id

    @property
    def data(self) -> dict[str, Any]:
        """The payload as a plain dict (as on the wire)."""
        return self.envelope.payload

    @property
    def payload(self) -> Payload:
        """The payload as its typed, frozen model (e.g. :class:`~dsec_core.events.SandboxReady`).

        Raises:
            dsec_core.events.UnsupportedSchemaVersion: a major version this client cannot read.
        """
        return self.envelope.decoded()

    def __repr__(self) -> str:
        return f"Event(seq={self.seq}, type={self.type!r}, aggregate_id={self.aggregate_id!r})"
