"""The asynchronous client: :class:`DSec` (a connection to the bus as this machine's user) and
:class:`Sandbox` (one sandbox: its events, state, logs, exec, snapshots, stop).

It signs as ``dsec`` does (the user's certified key: ``DSEC_CREDENTIAL``, ``dsec login``, or
on the operator's machine the local user), reads the same settings (``DSEC_*``, see README
"Settings") and verifies every event it hands over against the operator root, like every
consumer of the bus.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from dsec_core import lifecycle
from dsec_core.envelope import MalformedEnvelope, decode
from dsec_core.events import (
    EVENT_TYPES,
    BundleRef,
    Payload,
    SandboxStopRequested,
    SnapshotRequested,
    SnapshotRestoreRequested,
    SpecSubmitted,
)
from dsec_core.ids import new_sandbox_id
from dsec_core.settings import Settings
from dsec_core.subjects import (
    ALL_EVENTS,
    STREAM,
    InvalidSubjectToken,
    aggregate_filter,
    filter_for,
    subject_for,
)

from dsec_client import remote
from dsec_client.code import SpecLike, spec_text, upload_code
from dsec_client.errors import (
    ConfigError,
    DepsConflict,
    DSecError,
    InvalidInput,
    NotFound,
    RequestFailed,
    SandboxEnded,
    SandboxExited,
    SandboxFailed,
    SpecRejected,
    Stalled,
    Timeout,
    Unreachable,
)
from dsec_client.events import Event
from dsec_client.identity import submitter, trust_anchor, user_identity

if TYPE_CHECKING:
    from dsec_core.bus import EventPublisher
    from dsec_core.trust import Gate
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext

log = logging.getLogger("dsec_client")

WAIT_FOR = {
    "validated": "spec.validated",
    "built": "env.built",
    "ready": "sandbox.ready",
    "exited": "sandbox.exited",
}
"""The wait levels of :meth:`Sandbox.wait` (and ``dsec submit --wait``) and their events."""

_ENDED: dict[str, type[SandboxEnded]] = {
    "rejected": SpecRejected,
    "conflict": DepsConflict,
    "failed": SandboxFailed,
    "exited": SandboxExited,
}
SNAPSHOT_ANSWERS = frozenset({"snapshot.taken", "snapshot.restored", "snapshot.failed"})

Since = datetime | timedelta | int | Literal["start"] | None


@dataclass(frozen=True)
class ExecResult:
    """What a command run in a sandbox (:meth:`Sandbox.exec`) returned."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class DSec:
    """A connection to DSec's event bus as this machine's user.

    ``async with DSec() as d:`` connects (settings from the environment, as ``dsec``), and
    closes on leaving. Nothing is signed until something is published (:meth:`submit`,
    :meth:`Sandbox.stop`, ...): reading events needs no identity.

    Args:
        settings: the settings to use (default: ``Settings()``, i.e. ``DSEC_*`` variables).
        verify: ``None`` (default) verifies every event against the operator root when one is
            known here, else warns once and hands events over unverified; ``True`` requires a
            trust root (:class:`ConfigError` without one); ``False`` skips verification.
        on_warning: called with each warning (an unverifiable event skipped, a weakened stream,
            a first-use login); default: logged on the ``dsec_client`` logger.
        name: the NATS connection name.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        verify: bool | None = None,
        on_warning: Callable[[str], None] | None = None,
        name: str = "dsec-client",
    ) -> None:
        self.settings = settings or Settings()
        self._verify = verify
        self._warn = on_warning or log.warning
        self._name = name
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._publisher: EventPublisher | None = None
        self._identity: tuple[Any, Any] | None = None
        self._gate: Gate | None = None
        self._gate_made = False

    # --- connection ---------------------------------------------------------------------------

    async def __aenter__(self) -> DSec:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect to NATS and check the event stream (never changes it).

        Raises:
            ConfigError: a NATS credential or TLS setting names an unusable file.
            Unreachable: NATS does not answer, or the stream does not exist.
        """
        from dsec_core.bus import StreamWeakened, require_stream
        from dsec_core.natsclient import NatsSettingsError, connect

        url = self.settings.nats_endpoint()

        async def _quiet(exc: Exception) -> None:
            """nats-py prints a traceback per failed attempt; the caller gets one error."""

        try:
            self._nc = await connect(
                self.settings,
                self._name,
                fail_fast=True,
                connect_timeout=3,
                max_reconnect_attempts=3,
                allow_reconnect=True,
                error_cb=_quiet,
            )
        except NatsSettingsError as exc:
            raise ConfigError(str(exc)) from None
        except Exception as exc:  # any connect failure means "unreachable" to the user
            # a refusal names where (fail_fast); nats-py's errors say little beyond their kind
            reason = (
                str(exc)
                if isinstance(exc, ConnectionRefusedError) or "authorization" in str(exc).lower()
                else type(exc).__name__
            )
            raise Unreachable(
                f"cannot reach NATS at {_without_credentials(url)} ({reason}); "
                "start the stack with `dsec up` or set DSEC_NATS_URL (and its credentials: "
                "DSEC_NATS_CREDS, DSEC_NATS_NKEY_SEED or DSEC_NATS_USER/PASSWORD)"
            ) from None
        self._js = self._nc.jetstream()
        try:
            await require_stream(self._js)
        except StreamWeakened as exc:
            if "does not exist" in str(exc):
                await self.close()
                raise Unreachable(str(exc)) from None
            self._warn(str(exc))

    async def close(self) -> None:
        """Close the connection (idempotent)."""
        nc, gate = self._nc, self._gate
        self._nc, self._js, self._publisher, self._gate, self._gate_made = (
            None,
            None,
            None,
            None,
            False,
        )
        if gate is not None:
            await gate.keys.stop()
        if nc is not None:
            await nc.close()

    @property
    def nc(self) -> NATS:
        """The NATS connection (for what the client does not cover)."""
        if self._nc is None:
            raise DSecError("not connected: use `async with DSec() as d:` or `await d.connect()`")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context of :attr:`nc`."""
        if self._js is None:
            raise DSecError("not connected: use `async with DSec() as d:` or `await d.connect()`")
        return self._js

    @property
    def identity(self) -> tuple[Any, Any]:
        """This user's signing key and certificate (loaded on first use).

        Raises:
            ConfigError: no usable identity (``dsec login``).
        """
        if self._identity is None:
            key, cert, note = user_identity(self.settings)
            if note:
                self._warn(note)
            self._identity = (key, cert)
        return self._identity

    async def publisher(self) -> EventPublisher:
        """The publisher signing as this user; its key is registered in the log on first use."""
        if self._publisher is None:
            from dsec_core.bus import EventPublisher
            from dsec_core.signing import Signer

            key, cert = self.identity
            publisher = EventPublisher(
                self.js, Signer(cert.subject, key, tenant=cert.tenant), certificate=cert
            )
            await _published(publisher.register_key())
            self._publisher = publisher
        return self._publisher

    def gate(self) -> Gate | None:
        """The trust gate every event passes (``None``: not verifying, see ``verify``)."""
        if not self._gate_made:
            from dsec_core.trust import Gate, KeyRing

            self._gate_made = True
            anchor = None if self._verify is False else trust_anchor(self.settings)
            if anchor is None and self._verify:
                raise ConfigError(
                    "no trust root known here (DSEC_TRUST_ROOT, or `dsec login --credential "
                    "FILE`): events cannot be verified"
                )
            if anchor is None and self._verify is None:
                self._warn(
                    "no trust root known here (DSEC_TRUST_ROOT, or `dsec login --credential "
                    "FILE`): events are shown as they come, unverified"
                )
            if anchor is not None:
                self._gate = Gate(KeyRing(self.nc, self.js, anchor), self.js, None)
        return self._gate

    # --- sandboxes ----------------------------------------------------------------------------

    async def submit(
        self,
        spec: SpecLike,
        code: str | os.PathLike[str] | BundleRef | None = None,
        *,
        filename: str | None = None,
        start_from_snapshot: str | None = None,
        also: Sequence[Payload] = (),
        handover_from: str | None = None,
    ) -> Sandbox:
        """Submit a spec (a path, YAML text or dict) with its code directory; return the new
        sandbox at once (follow it with :meth:`Sandbox.wait` or :meth:`Sandbox.events`).

        ``code``: a directory, bundled (the spec's ``include_code`` patterns and size bound
        apply) and stored content-addressed in the object store, or a bundle already stored.
        ``filename``: the name the services report errors against (default: the file's, or
        ``spec.yaml``). ``start_from_snapshot``: the snapshot its code starts from. ``also``:
        payloads published on the sandbox right after ``spec.submitted``. ``handover_from``: a
        running sandbox of this tenant whose state and tool name the new one takes over in a
        live hand-over (``dsec sandbox upgrade``; follow it until ``state.handed_over``).

        Raises:
            InvalidInput: unreadable spec, code that is no directory or cannot be bundled, an
                event over the bus' size limit.
            Refused: the policy service refused to store the code (an unknown or revoked key).
            Unreachable: no policy service answered, or the object store cannot be written.
        """
        text, default_name = spec_text(spec)
        if handover_from is not None:
            self.sandbox(handover_from)  # a valid sandbox id, or InvalidInput
        skipped: list[str] = []
        code_ref = code if isinstance(code, BundleRef) else None
        if code is not None and code_ref is None:
            assert not isinstance(code, BundleRef)
            code_ref = await self.upload_code(Path(code), text, skipped)
        sandbox_id = new_sandbox_id()
        start = (await self.js.stream_info(STREAM)).state.last_seq + 1
        publisher = await self.publisher()
        await _published(
            publisher.publish(
                SpecSubmitted(
                    spec_yaml=text,
                    filename=filename or default_name,
                    code=code_ref,
                    submitted_by=submitter(),
                    start_from_snapshot=start_from_snapshot,
                    handover_from=handover_from,
                ),
                aggregate_id=sandbox_id,
            )
        )
        for payload in also:
            await _published(publisher.publish(payload, aggregate_id=sandbox_id))
        return Sandbox(self, sandbox_id, start_seq=start, skipped=skipped)

    async def upload_code(
        self, code: Path, spec: SpecLike, skipped: list[str] | None = None
    ) -> BundleRef:
        """Bundle the directory ``code`` (the spec's ``include_code`` patterns and size bound
        apply) and store it under this user's tenant with a one-time grant of the policy
        service (no object-store credentials needed); ``skipped`` receives the special files
        left out. :meth:`submit` does this for a ``code`` directory.

        Raises:
            InvalidInput: code that is no directory or cannot be bundled.
            Refused: the policy service refused (an unknown or revoked key, ...).
            Unreachable: no policy service answered, or the object store refused or failed.
        """
        text, _ = spec_text(spec)
        gate = self.gate()
        if gate is None:
            raise ConfigError(
                "no trust root known here (DSEC_TRUST_ROOT, or `dsec login --credential FILE`): "
                "the policy service's upload grant cannot be checked"
            )
        await self.publisher()  # the service finds this user's key in the log
        return await upload_code(
            code, text, nc=self.nc, gate=gate, identity=self.identity, skipped=skipped
        )

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """An existing sandbox by id (``sbx_...``), to follow or act on; nothing is read yet.

        Raises:
            InvalidInput: not a valid sandbox id.
        """
        try:
            subject_for("spec.submitted", sandbox_id)
        except InvalidSubjectToken as exc:
            raise InvalidInput(f"sandbox id: {exc}") from None
        return Sandbox(self, sandbox_id)

    # --- events -------------------------------------------------------------------------------

    async def events(
        self,
        type: str | Sequence[str] | None = None,
        *,
        since: Since = None,
        sandbox: str | None = None,
    ) -> AsyncIterator[Event]:
        """Every verified event of the log as it is published, forever (break to stop).

        Args:
            type: only events of this type (or these types), e.g. ``"policy.violation"``.
            since: where to start: ``None`` new events only; ``"start"`` the first event; a
                stream sequence (``int``); a time (``datetime``); an age (``timedelta``).
            sandbox: only the events of this sandbox.

        Raises:
            InvalidInput: an unknown event type.
        """
        types = [type] if isinstance(type, str) else list(type or [])
        unknown = [t for t in types if t not in EVENT_TYPES]
        if unknown:
            raise InvalidInput(
                f"not an event type: {', '.join(unknown)}; valid: {', '.join(sorted(EVENT_TYPES))}"
            )
        if sandbox is not None:
            filt = aggregate_filter("sandbox", self.sandbox(sandbox).id)
        elif len(types) == 1:
            filt = filter_for(types[0])
        else:
            filt = ALL_EVENTS
        start = await self._start_seq(since)
        async for batch in self.follow(filt, start):
            for event in batch:
                if not types or event.type in types:
                    yield event

    async def _start_seq(self, since: Since) -> int:
        if since == "start":
            return 1
        if isinstance(since, int):
            return max(since, 1)
        last = int((await self.js.stream_info(STREAM)).state.last_seq)
        if since is None:
            return last + 1
        when = datetime.now(UTC) - since if isinstance(since, timedelta) else since
        return await _seq_at(self.js, when if when.tzinfo else when.replace(tzinfo=UTC), last)

    async def follow(
        self, filter_subject: str, start_seq: int, *, idle_s: float = 0.25
    ) -> AsyncIterator[list[Event]]:
        """Batches of verified events on ``filter_subject`` from ``start_seq``, forever; an
        empty batch whenever the reader caught up and ``idle_s`` passed (a tick to check
        deadlines on). Malformed and unauthentic messages are skipped with a warning."""
        from dsec_core.bus import follow

        gate = self.gate()
        async for raw in follow(
            self.js, filter_subject=filter_subject, start_seq=start_seq, idle_s=idle_s
        ):
            batch: list[Event] = []
            for seq, data in raw:
                try:
                    envelope = decode(data)
                except MalformedEnvelope as exc:
                    self._warn(f"seq {seq}: malformed event skipped: {exc}")
                    continue
                if gate is not None and await gate.authentic(data, stream_seq=seq) is None:
                    # A forged or unauthorized message: not an event of the log's producers.
                    self._warn(f"ignored an unauthentic {envelope.type} at seq {seq}")
                    continue
                batch.append(Event(seq, envelope, verified=gate is not None))
            yield batch

    async def request(
        self,
        payload: Payload,
        aggregate_id: str,
        answers: frozenset[str],
        timeout: float,
    ) -> Event:
        """Publish a request signed by the user; return the first verified event of
        ``answers`` caused by it on the request's aggregate.

        Raises:
            InvalidInput: ``aggregate_id`` is not a valid id.
            Timeout: no answer within ``timeout`` seconds.
        """
        try:
            subject_for(payload.TYPE, aggregate_id)
        except InvalidSubjectToken as exc:
            raise InvalidInput(f"{payload.AGGREGATE} id: {exc}") from None
        start = (await self.js.stream_info(STREAM)).state.last_seq + 1
        publisher = await self.publisher()
        published = await _published(publisher.publish(payload, aggregate_id=aggregate_id))
        request_id = published.envelope.id
        deadline = time.monotonic() + timeout
        async for batch in self.follow(aggregate_filter(payload.AGGREGATE, aggregate_id), start):
            for event in batch:
                if event.envelope.causation_id == request_id and event.type in answers:
                    return event
            if time.monotonic() > deadline:
                break
        raise Timeout(f"no answer to {payload.TYPE} for {aggregate_id} within {timeout:.0f} s")

    async def last(self, event_type: str, aggregate_id: str) -> Event | None:
        """The newest verified event of ``event_type`` about ``aggregate_id`` (``None``: none)."""
        from dsec_core.trust import scan_seq

        gate = self.gate()
        subject = subject_for(event_type, aggregate_id)
        found: Event | None = None
        async for seq, data in scan_seq(self.js, subject, limit=1 << 20):
            try:
                envelope = decode(data)
            except MalformedEnvelope:
                continue
            if envelope.subject != subject:
                continue
            if gate is not None and await gate.authentic(data, stream_seq=seq) is None:
                continue
            found = Event(seq, envelope, verified=gate is not None)
        return found


class Sandbox:
    """One sandbox: from :meth:`DSec.submit` or :meth:`DSec.sandbox`.

    Attributes:
        id: its id (``sbx_...``).
        skipped: special files of the code directory the bundle left out (not code).
        lifecycle: its state as of the events last read (:class:`dsec_core.lifecycle.Lifecycle`).
    """

    def __init__(
        self,
        client: DSec,
        sandbox_id: str,
        *,
        start_seq: int | None = None,
        skipped: Sequence[str] = (),
    ) -> None:
        self.client = client
        self.id = sandbox_id
        self.skipped = list(skipped)
        self.lifecycle = lifecycle.Lifecycle()
        self._start_seq = start_seq

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, state={self.state!r})"

    @property
    def state(self) -> str:
        """``submitted``, ``validated``, ``built``, ``pending``, ``running``, ``exited``,
        ``failed``, ... as of the events last read (``unknown`` before any)."""
        return self.lifecycle.state

    async def _start(self) -> int:
        """Where its events begin: its first ``spec.submitted`` (read once)."""
        if self._start_seq is None:
            from dsec_core.trust import scan_seq

            async for seq, _ in scan_seq(self.client.js, subject_for("spec.submitted", self.id), 1):
                self._start_seq = seq
            if self._start_seq is None:
                raise NotFound(f"no sandbox {self.id!r} in the event log (see `dsec sandbox list`)")
        return self._start_seq

    async def _folded(self) -> AsyncIterator[Event | None]:
        """Its events from the start, one by one, each marked when the lifecycle fold did not
        apply it; ``lifecycle`` is the state after the event just yielded. ``None`` is an idle
        tick (the reader caught up, see :meth:`DSec.follow`)."""
        life = lifecycle.Lifecycle()
        start = await self._start()
        async for batch in self.client.follow(aggregate_filter("sandbox", self.id), start):
            for event in batch:
                before = life
                life = lifecycle.step(
                    before, event.type, event.data, event_id=event.id, tenant=event.tenant
                )
                refused = len(life.refused) > len(before.refused)
                self.lifecycle = life
                yield replace(event, ignored=life.refused[-1].describe()) if refused else event
            if not batch:
                yield None

    async def events(self, *, until_end: bool = True) -> AsyncIterator[Event]:
        """Its verified events, from its submission on, as they come; with ``until_end`` the
        iteration ends after its terminal event (exited, failed, rejected, conflict)."""
        async for event in self._folded():
            if event is None:
                continue
            yield event
            if until_end and event.ignored is None and self.lifecycle.terminal:
                return

    async def wait(
        self,
        until: str = "ready",
        *,
        timeout: float = 900.0,
        stall: float | None = None,
        on_event: Callable[[Event], object] | None = None,
    ) -> Event:
        """Follow its events until ``until`` (``validated``, ``built``, ``ready``, ``exited``,
        or an event type) happens; return that event.

        Args:
            timeout: give up after this many seconds.
            stall: give up when no event came for this long (a sandbox pending for a node is
                not stalled); ``None``: only ``timeout``.
            on_event: called with every event on the way (e.g. to print it).

        Raises:
            SpecRejected, DepsConflict, SandboxFailed, SandboxExited: it ended first (each a
                :class:`SandboxEnded` with ``state``, ``reason`` and the ``event``).
            Stalled, Timeout: it did not get there in time (``last_event``: where it stopped).
        """
        target = WAIT_FOR.get(until, until)
        if target not in EVENT_TYPES:
            raise InvalidInput(
                f"wait for {until!r}: use one of {', '.join(WAIT_FOR)} or an event type"
            )
        deadline = time.monotonic() + timeout
        last_at, last_type = time.monotonic(), None
        async for event in self._folded():
            if event is not None:
                last_at, last_type = time.monotonic(), event.type
                if on_event is not None:
                    on_event(event)
                if event.ignored is None and event.type == target:
                    return event
                life = self.lifecycle
                if event.ignored is None and life.terminal:
                    raise _ENDED[life.state](self.id, life.state, life.reason, event)
            now = time.monotonic()
            if now > deadline:
                raise Timeout(
                    f"{self.id}: no {target} within {timeout:.0f} s (last: {last_type})", last_type
                )
            # A pending sandbox waits for a node (one joins, frees capacity, is uncordoned):
            # that is not a stalled chain; only the overall timeout ends the wait.
            if stall is not None and self.state != "pending" and now - last_at > stall:
                raise Stalled(
                    f"{self.id}: no event for {stall:.0f} s after {last_type or 'nothing'}; "
                    f"waiting for {target}. Is the service that handles it running?",
                    last_type,
                )
        raise AssertionError("unreachable: the log is followed forever")

    async def ended(self) -> Event | None:
        """Its terminal event if it has ended (``sandbox.exited``, ``sandbox.failed``,
        ``spec.rejected``, ``deps.conflict``), else ``None``.

        Raises:
            NotFound: no such sandbox.
        """
        await self._start()
        ends = [await self.client.last(t, self.id) for t in _TERMINAL_TYPES]
        found = [e for e in ends if e is not None]
        return max(found, key=lambda e: e.seq) if found else None

    async def stop(self, *, grace: float = 5.0, wait: bool = True) -> int | None:
        """Ask its node agent to stop it (SIGTERM, SIGKILL after ``grace`` seconds); with
        ``wait``, wait for it to exit and return its exit code. A sandbox that already ended is
        left alone (its exit code is returned; ``None`` when it failed or never ran).

        Raises:
            NotFound: no such sandbox.
            Timeout: it did not exit within ``grace`` + 30 s (is its node agent running?).
        """
        ended = await self.ended()
        if ended is not None:
            code = ended.data.get("exit_code")
            return code if isinstance(code, int) else None
        start = (await self.client.js.stream_info(STREAM)).state.last_seq + 1
        publisher = await self.client.publisher()
        await _published(
            publisher.publish(
                SandboxStopRequested(requested_by=submitter(), grace_s=grace), aggregate_id=self.id
            )
        )
        if not wait:
            return None
        deadline = time.monotonic() + grace + 30
        filt = aggregate_filter("sandbox", self.id)
        async for batch in self.client.follow(filt, start):
            for event in batch:
                if event.type in ("sandbox.exited", "sandbox.failed"):
                    code = event.data.get("exit_code")
                    return code if isinstance(code, int) else None
            if time.monotonic() > deadline:
                raise Timeout(
                    f"{self.id} did not exit within {grace + 30:.0f} s; is its node agent "
                    "running? (`dsec status`)"
                )
        raise AssertionError("unreachable: the log is followed forever")

    async def snapshot(
        self,
        name: str,
        *,
        include_code: bool = True,
        include_deps: bool = True,
        timeout: float = 120.0,
    ) -> Event:
        """Take a snapshot named ``name`` (its node agent does, or the snapshot service when it
        runs nowhere); return ``snapshot.taken`` (files, bytes, manifest digest).

        Raises:
            RequestFailed: refused or failed (``reason``; ``event``: the ``snapshot.failed``).
            Timeout: no answer in time (is the snapshot service running?).
        """
        request = SnapshotRequested(
            name=name,
            requested_by=submitter(),
            include_code=include_code,
            include_deps=include_deps,
        )
        answer = await self.client.request(request, self.id, SNAPSHOT_ANSWERS, timeout)
        if answer.type != "snapshot.taken":
            reason = str(answer.data.get("reason"))
            raise RequestFailed(f"snapshot {name} of {self.id} failed: {reason}", reason, answer)
        return answer

    async def rollback(self, snapshot: str, *, timeout: float = 60.0) -> Event:
        """Put its code back on ``snapshot`` while it runs; return ``snapshot.restored``
        (files written and removed; ``note``: what could not be restored under a running
        process, e.g. a different dependency environment).

        Raises:
            RequestFailed: refused (an exited sandbox, an unknown or altered snapshot).
            Timeout: no answer in time.
        """
        request = SnapshotRestoreRequested(snapshot=snapshot, requested_by=submitter())
        answer = await self.client.request(request, self.id, SNAPSHOT_ANSWERS, timeout)
        if answer.type != "snapshot.restored":
            reason = str(answer.data.get("reason"))
            raise RequestFailed(
                f"rollback of {self.id} to {snapshot} failed: {reason}", reason, answer
            )
        return answer

    async def session(
        self,
        kind: Literal["logs", "exec", "cp"],
        args: dict[str, Any],
        on_output: Callable[[str, bytes], None],
        *,
        stdin: remote.StdinFeeder | None = None,
        driver: remote.Driver | None = None,
        on_frame: Callable[[dict[str, Any]], Any] | None = None,
    ) -> remote.Ended:
        """A remote logs/exec/cp session with its node agent (the protocol of
        :mod:`dsec_client.remote`); :meth:`logs` and :meth:`exec` are the simple forms."""
        gate = self.client.gate()
        if gate is None:
            raise ConfigError("remote logs and exec need the operator's trust root (`dsec login`)")
        await self.client.publisher()  # the key is registered in the log, where the node checks
        return await remote.session(
            self.client.nc,
            gate,
            self.client.identity,
            kind,
            self.id,
            args,
            on_output,
            stdin=stdin,
            driver=driver,
            on_frame=on_frame,
        )

    async def logs(
        self,
        *,
        follow: bool = False,
        stderr: bool = False,
        on_output: Callable[[bytes], None] | None = None,
    ) -> str:
        """Its output (stdout, or ``stderr``), kept after it exits, streamed encrypted from the
        node agent that runs it; with ``follow``, until it exits. ``on_output`` receives each
        chunk as it arrives. Returns the whole text (UTF-8, undecodable bytes replaced).

        Raises:
            Refused: not a user of its tenant, or it never ran (``reason``).
            Unreachable: its node agent does not answer.
        """
        chunks: list[bytes] = []

        def out(_: str, data: bytes) -> None:
            chunks.append(data)
            if on_output is not None:
                on_output(data)

        args = {"stream": "stderr" if stderr else "stdout", "follow": follow}
        await self.session("logs", args, out)
        return b"".join(chunks).decode(errors="replace")

    async def exec(self, argv: Sequence[str], *, input: bytes | None = None) -> ExecResult:
        """Run ``argv`` inside the running sandbox, with its isolation (without its secrets);
        ``input`` is the command's stdin (none: empty). Returns its exit code and output.

        Raises:
            InvalidInput: an empty command.
            Refused: not running, or not a user of its tenant (``reason``).
            RequestFailed: the command did not finish (the session ended first).
        """
        if not argv:
            raise InvalidInput("exec: give the command to run")
        out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}

        def collect(stream: str, data: bytes) -> None:
            out.get(stream, out["stdout"]).append(data)

        ended = await self.session(
            "exec", {"argv": list(argv)}, collect, stdin=remote.bytes_feeder(input or b"")
        )
        if ended.code is None:
            raise RequestFailed(f"the command did not finish: {ended.reason}", ended.reason)
        text = {k: b"".join(v).decode(errors="replace") for k, v in out.items()}
        return ExecResult(ended.code, text["stdout"], text["stderr"])


_TERMINAL_TYPES = ("sandbox.exited", "sandbox.failed", "spec.rejected", "deps.conflict")


async def _published(publishing: Any) -> Any:
    """Await a publish; an event over the bus' size limit is bad input."""
    from dsec_core.bus import EventTooLarge

    try:
        return await publishing
    except EventTooLarge as exc:
        raise InvalidInput(
            f"{exc}; nothing was published. Make it smaller (code goes in the bundle)"
        ) from None


async def _seq_at(js: JetStreamContext, when: datetime, last: int) -> int:
    """The stream sequence of the first event stored at or after ``when`` (``last + 1`` when
    there is none): asked of a one-message ephemeral consumer that starts by time."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=when,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=5.0,
        mem_storage=True,
        num_replicas=1,
    )
    sub = await js.pull_subscribe(ALL_EVENTS, stream=STREAM, config=config)
    try:
        msgs = await sub.fetch(1, timeout=1.0)
        return int(msgs[0].metadata.sequence.stream) if msgs else last + 1
    except TimeoutError:  # nothing stored after ``when``
        return last + 1
    finally:
        await sub.unsubscribe()


def _without_credentials(url: str) -> str:
    """``url`` with any ``user:password@`` (or ``token@``) part removed, for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    return f"{scheme}://{rest.rpartition('@')[2]}"
