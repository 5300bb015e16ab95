"""Postgres read models of specs and sandboxes, projected from the event log.

A sandbox's row is the one lifecycle fold (:mod:`dsec_core.lifecycle`) applied event by event:
its state, node, placement attempt and reason are what :func:`dsec_core.lifecycle.step` says. An
event the fold refuses (a second ``sandbox.ready``, a ``sandbox.ready`` after the exit) leaves
the row as it was and is kept in the timeline with ``refused`` in its summary.

The projector reads the stream from the position it stored, and applies each event and the new
position in one transaction: a crash between two events replays the second, never the first, so
projections are exactly-once. A rebuild is ``DROP`` + replay from sequence 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
import msgspec
from nats.js import JetStreamContext

from dsec_core import lifecycle
from dsec_core.bus import follow, replay
from dsec_core.envelope import Envelope, MalformedEnvelope, decode
from dsec_core.subjects import ROOT
from dsec_core.trust import Gate

T = TypeVar("T")

log = logging.getLogger(__name__)


def _json(value: Any) -> str:
    """``value`` as JSON text for a ``jsonb`` column, by msgspec: a heartbeat's 13 KB inventory
    of an 8-GPU node with NVLink in 25 us (``json.dumps``: 250; 1,000 nodes send 200 a second);
    a non-finite float becomes ``null``, which Postgres takes (it refuses ``NaN``)."""
    return msgspec.json.encode(value).decode()


NAME = "sandboxes"

READ_ROLE = "dsec_reader"
"""The role users read the read models as: SELECT on their tables, nothing else. `dsec up`
creates it; in a deployment the operator does (README, *Read models*). Each projector grants it
its tables whenever it creates them (also after a rebuild), if the role exists."""

READ_TABLES = ("projection_state", "specs", "sandboxes", "sandbox_events", "nodes")
"""Every table :data:`READ_ROLE` may read."""

READER_MAX_TRANSACTION_S = 60.0
"""A reader's transaction open longer is ended by the projectors (:func:`end_stale_readers`):
users cannot hold the read models' locks, nor vacuum's horizon, for longer."""

READER_SETTINGS = (
    ("default_transaction_read_only", "on"),
    ("statement_timeout", "30s"),
    ("idle_in_transaction_session_timeout", "60s"),
    ("temp_file_limit", "256MB"),
)
"""The defaults of :data:`READ_ROLE`'s sessions (``ALTER ROLE ... SET``), in this order."""

READER_GUARD = "reader_role_guard"
"""The table where `dsec up` records the password verifier it gave :data:`READ_ROLE` (no role
but the stack's own may read it), so the projectors can set it back (:func:`restore_reader`)."""

READER_CHECK_S = 5.0
"""How often the projectors set :data:`READ_ROLE` back to what `dsec up` made it."""

_VERIFIER = re.compile(r"SCRAM-SHA-256\$[0-9]+:[A-Za-z0-9+/=]+\$[A-Za-z0-9+/=]+:[A-Za-z0-9+/=]+")


async def restore_reader(conn: asyncpg.Connection) -> list[str]:
    """Set :data:`READ_ROLE`'s password and session defaults back to what `dsec up` recorded,
    and return what was set back (``password``, ``settings``).

    Any role may change its own password and defaults: a user holding the shared read DSN could
    lock every other user out (a new password) or set their sessions' defaults (a 1 ms lock
    timeout). Needs a superuser (the password is read from ``pg_authid``) and the verifier `dsec
    up` recorded in :data:`READER_GUARD`; without either, nothing is done (a deployment's own
    roles are the operator's, README *Read models*)."""
    try:
        row = await conn.fetchrow(
            "SELECT a.rolpassword, g.verifier, ARRAY(SELECT s.setdatabase::text || ':' ||"
            " array_to_string(s.setconfig, ',') FROM pg_db_role_setting s"
            " WHERE s.setrole = a.oid ORDER BY 1) AS settings"
            f" FROM pg_authid a JOIN {READER_GUARD} g ON g.role = a.rolname"
            " WHERE a.rolname = $1",
            READ_ROLE,
        )
    except (asyncpg.InsufficientPrivilegeError, asyncpg.UndefinedTableError):
        return []
    if row is None or not _VERIFIER.fullmatch(row["verifier"]):
        return []
    expected = ["0:" + ",".join(f"{name}={value}" for name, value in READER_SETTINGS)]
    changes = [
        *([("password", f"ALTER ROLE {READ_ROLE} PASSWORD '{row['verifier']}'")]
          if row["rolpassword"] != row["verifier"] else []),
        *([("settings", reader_settings_sql())] if list(row["settings"]) != expected else []),
    ]  # fmt: skip
    for attempt in range(2 if changes else 0):
        try:
            async with conn.transaction():  # (waits at most the connection's lock_timeout)
                for _, sql in changes:
                    await conn.execute(sql)
            break
        except asyncpg.LockNotAvailableError:
            if attempt:
                raise
            # a reader holds the role's catalog row (an ALTER ROLE in a transaction left
            # open): the readers with a transaction open end, then once more
            await end_stale_readers(conn, 0)
    restored = [name for name, _ in changes]
    if restored:
        log.warning("read models: %s's %s had been changed; set back", READ_ROLE, restored)
    return restored


def reader_settings_sql(role: str = READ_ROLE) -> str:
    """SQL that takes back every default ``role`` has (in any database) and sets
    :data:`READER_SETTINGS` (the role name is the caller's, checked)."""
    sets = "; ".join(f"ALTER ROLE {role} SET {name} = '{value}'" for name, value in READER_SETTINGS)
    return (
        f"ALTER ROLE {role} RESET ALL; "
        "DO $$ DECLARE d text; BEGIN FOR d IN SELECT datname FROM pg_db_role_setting s"
        " JOIN pg_database db ON db.oid = s.setdatabase"
        f" WHERE s.setrole = '{role}'::regrole LOOP"
        f" EXECUTE format('ALTER ROLE {role} IN DATABASE %I RESET ALL', d); END LOOP; END $$; "
        f"{sets}"
    )


async def end_stale_readers(conn: asyncpg.Connection, older_than_s: float) -> int:
    """End the sessions of :data:`READ_ROLE` whose transaction has been open ``older_than_s``
    or more (0: every open one), waiting up to 5 s for each to be gone; return how many.
    Needs to see and signal them: a superuser, or a role granted :data:`READ_ROLE` (the
    README's deployment SQL); without it nothing is ended, 0 is returned, and no error is
    raised (the caller's transaction goes on)."""
    try:
        ended = await conn.fetchval(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000))"
            " FROM pg_stat_activity"
            " WHERE usename = $1 AND xact_start IS NOT NULL"
            " AND xact_start <= now() - make_interval(secs => $2)"
            # (never an error inside the caller's transaction: only when it may signal them)
            " AND ((SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
            " OR pg_has_role(current_user, $1, 'USAGE')"
            " OR pg_has_role(current_user, 'pg_signal_backend', 'USAGE'))",
            READ_ROLE,
            float(older_than_s),
        )
    except asyncpg.InsufficientPrivilegeError:
        return 0
    if ended:
        log.warning("read models: ended %d reader session(s) holding a transaction", ended)
    return int(ended or 0)


def grant_readers(*tables: str) -> str:
    """SQL that grants :data:`READ_ROLE` SELECT on ``tables`` when that role exists."""
    return (
        "DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '" + READ_ROLE + "') "
        f"THEN GRANT SELECT ON {', '.join(tables)} TO {READ_ROLE}; END IF; END $$;"
    )


SCHEMA = """
CREATE TABLE IF NOT EXISTS projection_state (
    name text PRIMARY KEY,
    applied_seq bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS specs (
    sandbox_id text PRIMARY KEY,
    name text,
    filename text NOT NULL,
    spec_digest text,
    spec_yaml text NOT NULL,
    status text NOT NULL,
    errors jsonb NOT NULL DEFAULT '[]',
    plan jsonb,
    submitted_by text NOT NULL DEFAULT '',
    submitted_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id text PRIMARY KEY,
    name text,
    state text NOT NULL,
    terminal boolean NOT NULL DEFAULT false,
    node_id text,
    lock_hash text,
    exit_code integer,
    reason text,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    last_event text NOT NULL,
    last_seq bigint NOT NULL
);
-- Refusals the node agent recorded (each policy.violation, plus each summary's count) and
-- reports of the sandbox's own semantic layer (policy.reported, the sandbox's claims).
-- The placement attempt of node_id (sandbox.scheduled; 2+ after a node was lost).
-- Times a stateful sandbox was started again in place after dying (sandbox.restarted).
-- (Each ALTER only when its column is missing: even IF NOT EXISTS takes the table's exclusive
-- lock, which any reader's open transaction would hold off, and the writes queue behind it.)
DO $$ DECLARE c record; BEGIN
  FOR c IN SELECT * FROM (VALUES ('refusals', 'bigint'), ('reports', 'bigint'),
                                 ('attempt', 'integer'), ('restarts', 'integer')) AS v(name, type)
  LOOP
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'sandboxes'::regclass
                   AND attname = c.name AND NOT attisdropped) THEN
      EXECUTE format('ALTER TABLE sandboxes ADD COLUMN %I %s NOT NULL DEFAULT 0', c.name, c.type);
    END IF;
  END LOOP;
END $$;
-- The live sandboxes by state, for the stuck-request gauges (live_states).
CREATE INDEX IF NOT EXISTS sandboxes_live ON sandboxes (state) WHERE NOT terminal;
CREATE TABLE IF NOT EXISTS sandbox_events (
    sandbox_id text NOT NULL,
    seq bigint NOT NULL,
    type text NOT NULL,
    producer text NOT NULL,
    time timestamptz NOT NULL,
    summary jsonb NOT NULL,
    PRIMARY KEY (sandbox_id, seq)
);
"""

DROP = "DROP TABLE IF EXISTS sandbox_events, sandboxes, specs, projection_state;"

_SUMMARY_KEYS = (
    "reason",
    "exit_code",
    "stage",
    "rule_id",
    "node_id",
    "attempt",
    "previous_node",
    "snapshot",
    "name",
    "kind",
    "layer",
    "action",
    "operation",
    "count",
    "restarts",
    "signal",
)


def summarize(env: Envelope) -> dict[str, Any]:
    """A short, secret-free summary of an event for the timeline."""
    return {k: env.payload[k] for k in _SUMMARY_KEYS if k in env.payload}


async def ensure_schema(conn: asyncpg.Connection) -> None:
    """Create the read-model tables when missing (serialized: concurrent DDL races). A lock a
    reader holds is waited for 10 s at most (the caller retries; readers' transactions older
    than :data:`READER_MAX_TRANSACTION_S` are ended first)."""
    await end_stale_readers(conn, READER_MAX_TRANSACTION_S)
    async with conn.transaction():
        await conn.execute("SET LOCAL lock_timeout = '10s'")
        await conn.execute("SELECT pg_advisory_xact_lock(7271)")
        await conn.execute(SCHEMA)
        await conn.execute(
            grant_readers("projection_state", "specs", "sandboxes", "sandbox_events")
        )


@dataclass(frozen=True)
class LiveState:
    """The sandboxes in one non-terminal state: how many, and how long the oldest of them has
    had no event (a request stuck in ``submitted`` or ``scheduled`` grows this)."""

    count: int
    oldest_s: float


async def live_states(conn: asyncpg.Connection) -> dict[str, LiveState]:
    """The read model's non-terminal sandboxes by state (states with none are absent)."""
    rows = await conn.fetch(
        "SELECT state, count(*) AS n,"
        " GREATEST(EXTRACT(EPOCH FROM now() - min(updated_at)), 0)::float8 AS oldest"
        " FROM sandboxes WHERE NOT terminal GROUP BY state"
    )
    return {r["state"]: LiveState(int(r["n"]), float(r["oldest"])) for r in rows}


async def watch_live_states(
    dsn: str,
    stop: asyncio.Event,
    sink: Callable[[dict[str, LiveState] | None], None],
    interval_s: float = 15.0,
) -> None:
    """Until ``stop`` is set: hand :func:`live_states` to ``sink`` every ``interval_s`` seconds
    (``None`` when the read model could not be read; the next round tries again)."""
    conn: asyncpg.Connection | None = None
    try:
        while not stop.is_set():
            try:
                if conn is None or conn.is_closed():
                    conn = await asyncpg.connect(dsn)
                    await ensure_schema(conn)  # the projector may not have created it yet
                states: dict[str, LiveState] | None = await live_states(conn)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.debug("read model not read for the live-state gauges: %s", exc)
                states = None
            sink(states)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        if conn is not None:
            await conn.close()


async def applied_seq(conn: asyncpg.Connection) -> int:
    """The last stream sequence applied to the read models."""
    value = await conn.fetchval("SELECT applied_seq FROM projection_state WHERE name = $1", NAME)
    return int(value or 0)


async def _apply_spec(conn: asyncpg.Connection, env: Envelope) -> None:
    p = env.payload
    if env.type == "spec.submitted":
        await conn.execute(
            "INSERT INTO specs (sandbox_id, filename, spec_yaml, status, submitted_by,"
            " submitted_at) VALUES ($1, $2, $3, 'submitted', $4, $5)"
            " ON CONFLICT (sandbox_id) DO NOTHING",
            env.aggregate_id,
            p.get("filename", "dsec.yaml"),
            p.get("spec_yaml", ""),
            p.get("submitted_by", ""),
            env.time,
        )
    elif env.type == "spec.validated":
        await conn.execute(
            "UPDATE specs SET status = 'validated', name = $2, spec_digest = $3, plan = $4"
            " WHERE sandbox_id = $1",
            env.aggregate_id,
            p["name"],
            p["spec_digest"],
            _json(p["plan"]),
        )
    elif env.type == "spec.rejected":
        await conn.execute(
            "UPDATE specs SET status = 'rejected', errors = $2 WHERE sandbox_id = $1",
            env.aggregate_id,
            _json(p["errors"]),
        )


def _lifecycle_of(row: asyncpg.Record | None) -> lifecycle.Lifecycle:
    """The fold's state as the row stored it (no row: nothing seen yet)."""
    if row is None:
        return lifecycle.Lifecycle()
    return lifecycle.Lifecycle(
        state=row["state"],
        node_id=row["node_id"],
        attempt=row["attempt"],
        exit_code=row["exit_code"],
        reason=row["reason"],
        restarts=row["restarts"],
    )


async def _apply_sandbox(conn: asyncpg.Connection, seq: int, env: Envelope) -> str | None:
    """Fold one event into the sandbox's row; return why the fold refused it (else ``None``)."""
    if env.type not in lifecycle.LIFECYCLE_TYPES:  # a fact: violation, context, snapshot...
        refusals, reports = _tallies(env)
        await conn.execute(
            "UPDATE sandboxes SET updated_at = GREATEST(updated_at, $2),"
            " refusals = refusals + $3,"
            " reports = reports + $4 WHERE sandbox_id = $1",
            env.aggregate_id,
            env.time,
            refusals,
            reports,
        )
        return None
    row = await conn.fetchrow(
        "SELECT state, node_id, attempt, exit_code, reason, restarts FROM sandboxes"
        " WHERE sandbox_id = $1 FOR UPDATE",
        env.aggregate_id,
    )
    before = _lifecycle_of(row)
    after = lifecycle.step(before, env.type, env.payload, event_id=env.id, tenant=env.tenant)
    if len(after.refused) > len(before.refused):
        why = after.refused[-1].describe()
        log.warning("projection leaves %s as it was: %s", env.aggregate_id, why)
        return why
    p = env.payload
    node_id = after.node_id
    if env.type == "sandbox.ready":  # the node that runs it says so itself
        node_id = p.get("node_id") or node_id
    await conn.execute(
        """
        INSERT INTO sandboxes AS s (sandbox_id, name, state, terminal, node_id, attempt,
            lock_hash, exit_code, reason, created_at, updated_at, last_event, last_seq, restarts)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $10, $11, $12, $13)
        ON CONFLICT (sandbox_id) DO UPDATE SET
            name = COALESCE(EXCLUDED.name, s.name),
            state = EXCLUDED.state,
            terminal = EXCLUDED.terminal,
            node_id = EXCLUDED.node_id,
            attempt = EXCLUDED.attempt,
            lock_hash = COALESCE(EXCLUDED.lock_hash, s.lock_hash),
            exit_code = EXCLUDED.exit_code,
            reason = EXCLUDED.reason,
            updated_at = GREATEST(s.updated_at, EXCLUDED.updated_at),
            last_event = EXCLUDED.last_event,
            last_seq = EXCLUDED.last_seq,
            restarts = EXCLUDED.restarts
        """,
        env.aggregate_id,
        p.get("name") if env.type == "spec.validated" else None,
        after.state,
        after.terminal,
        node_id,
        after.attempt,
        p.get("lock_hash"),
        after.exit_code,
        after.reason,
        env.time,
        env.type,
        seq,
        after.restarts,
    )
    return None


def _tallies(env: Envelope) -> tuple[int, int]:
    """``(refusals, reports)`` an event adds to its sandbox's row."""
    if env.type == "policy.violation":
        return (1 if env.payload.get("action") == "deny" else 0), 0
    if env.type == "policy.violation_summary":
        return int(env.payload.get("count") or 0), 0
    if env.type == "policy.reported":
        return 0, 1
    return 0, 0


async def apply_event(conn: asyncpg.Connection, seq: int, env: Envelope) -> None:
    """Apply one event to the read models (call inside a transaction)."""
    if env.aggregate != "sandbox":
        return
    await _apply_spec(conn, env)
    refused = await _apply_sandbox(conn, seq, env)
    summary = summarize(env)
    if refused is not None:
        summary["refused"] = refused
    await conn.execute(
        "INSERT INTO sandbox_events (sandbox_id, seq, type, producer, time, summary)"
        " VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
        env.aggregate_id,
        seq,
        env.type,
        env.producer,
        env.time,
        _json(summary),
    )


async def apply_batch(
    conn: asyncpg.Connection, batch: Sequence[tuple[int, bytes]], gate: Gate | None = None
) -> int:
    """Apply a batch and the new position in one transaction; return the position.

    With a ``gate``, only authentic, authorized events reach the read models: a forged
    ``sandbox.exited`` never shows a running sandbox as ended.
    """
    async with conn.transaction():
        current = await applied_seq(conn)
        for seq, data in batch:
            if seq <= current:
                continue
            try:
                env = decode(data) if gate is None else await gate.authentic(data, stream_seq=seq)
            except MalformedEnvelope as exc:
                log.error("projection skips malformed event at seq %d: %s", seq, exc)
                env = None
            if env is not None:
                await apply_event(conn, seq, env)
            elif gate is not None:
                log.warning("projection skips unauthentic event at seq %d", seq)
            current = seq
        await conn.execute(
            "INSERT INTO projection_state (name, applied_seq) VALUES ($1, $2)"
            " ON CONFLICT (name) DO UPDATE SET applied_seq = EXCLUDED.applied_seq",
            NAME,
            current,
        )
    return current


@dataclass
class Projector:
    """Keeps the read models up to date by following the stream from its stored position."""

    js: JetStreamContext
    dsn: str
    gate: Gate | None = None
    batch_size: int = 256

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the stream until ``stop`` is set; reconnect after a failure (Postgres restart,
        a rebuild in progress) from the stored position, with backoff. The nodes table is
        followed beside it (:class:`NodeProjector`)."""
        nodes = asyncio.create_task(NodeProjector(self.js, self.dsn, self.gate).run(stop))
        watch = asyncio.create_task(self._watch_readers(stop))
        try:
            await self._run_sandboxes(stop)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            if stop.is_set():
                try:
                    await nodes
                finally:
                    nodes.cancel()  # no-op when it ended; stops it when we are cancelled
            else:
                nodes.cancel()

    async def _watch_readers(self, stop: asyncio.Event) -> None:
        """Every :data:`READER_CHECK_S`, set the read role back to what `dsec up` made it
        (:func:`restore_reader`); every half of :data:`READER_MAX_TRANSACTION_S`, end readers'
        transactions older than that. One connection, opened again after a failure."""
        conn: asyncpg.Connection | None = None
        ended_at = asyncio.get_running_loop().time()
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), READER_CHECK_S)
                    return
                try:
                    if conn is None or conn.is_closed():
                        # (bounded waits: a reader holding a lock never stalls the watch)
                        conn = await asyncpg.connect(
                            self.dsn,
                            server_settings={"lock_timeout": "2s", "statement_timeout": "15s"},
                        )
                    now = asyncio.get_running_loop().time()
                    if now - ended_at >= READER_MAX_TRANSACTION_S / 2:
                        ended_at = now
                        await end_stale_readers(conn, READER_MAX_TRANSACTION_S)
                    await restore_reader(conn)
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                    log.warning("projector: watching readers: %s", exc)
                    if conn is not None:
                        conn.terminate()
                        conn = None
        finally:
            if conn is not None:
                conn.terminate()

    async def _run_sandboxes(self, stop: asyncio.Event) -> None:
        delay = 0.5
        while not stop.is_set():
            try:
                await self._follow(stop)
                return
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("projector: %s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _follow(self, stop: asyncio.Event) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:
            await ensure_schema(conn)
            start = await applied_seq(conn) + 1
            batches = follow(
                self.js, start_seq=start, batch=self.batch_size, filter_subject=f"{ROOT}.sandbox.>"
            )
            async for batch in until_set(stop, batches):
                if batch:
                    await apply_batch(conn, batch, self.gate)
        finally:
            await conn.close()


async def until_set(stop: asyncio.Event, batches: AsyncIterator[T]) -> AsyncIterator[T]:
    """The items of ``batches`` until ``stop`` is set, then closes it.

    A wait for the next item (an idle read waits up to :func:`~dsec_core.bus.follow`'s
    ``idle_s`` for one) ends as soon as ``stop`` is set: a stopping service does not wait for
    it. What the caller does with an item it was given is never interrupted: ``stop`` is
    looked at only while waiting for the next one."""
    stopping = asyncio.ensure_future(stop.wait())
    step: asyncio.Future[T] | None = None
    try:
        while not stop.is_set():
            step = asyncio.ensure_future(anext(batches))
            await asyncio.wait({step, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return  # stopped while waiting (the read is cancelled below)
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        stopping.cancel()
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await step
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()


async def _rebuild(
    conn: asyncpg.Connection,
    drop: str,
    create: Callable[[asyncpg.Connection], Any],
    fill: Callable[[asyncpg.Connection], Any],
) -> int:
    """``drop``, ``create`` and ``fill`` (the replay) in one transaction, so the live projector
    cannot write into the new tables meanwhile (its position there would make the replay skip
    what came before it; it waits, then resumes from the rebuilt position). Every reader's
    open transaction is ended first, and again each time a lock is not had within 2 s or a
    deadlock ends the attempt (a reader that opens another meanwhile cannot hold the DROP, and
    everything queued behind it, for long). The projectors' lock and ``projection_state`` are
    taken first, as the projectors take them, so the DROP deadlocks no batch."""
    for attempt in range(30):
        await end_stale_readers(conn, 0)
        try:
            async with conn.transaction():
                await conn.execute("SET LOCAL lock_timeout = '2s'")
                await conn.execute("SELECT pg_advisory_xact_lock(7271)")
                await conn.execute(
                    "DO $$ BEGIN IF to_regclass('projection_state') IS NOT NULL THEN"
                    " LOCK TABLE projection_state IN ACCESS EXCLUSIVE MODE; END IF; END $$;"
                )
                await conn.execute(drop)
                await create(conn)
                return int(await fill(conn))
        except (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError):
            if attempt == 29:
                raise
            log.warning("read models: a lock is held; ending readers and trying again")
    raise AssertionError("the last attempt returns or raises")


async def rebuild(js: JetStreamContext, dsn: str, gate: Gate | None = None) -> int:
    """Drop the read models and replay the whole stream into them; return the position."""
    await rebuild_nodes(js, dsn, gate)
    conn = await asyncpg.connect(dsn)

    async def fill(conn: asyncpg.Connection) -> int:
        batch: list[tuple[int, bytes]] = []
        position = 0
        async for item in replay(js, filter_subject=f"{ROOT}.sandbox.>"):
            batch.append(item)
            if len(batch) >= 512:
                position = await apply_batch(conn, batch, gate)
                batch = []
        if batch:
            position = await apply_batch(conn, batch, gate)
        return position

    try:
        return await _rebuild(conn, DROP, ensure_schema, fill)
    finally:
        await conn.close()


# ============================================================================ nodes
# The nodes read model: one row per node from node.joined, node.heartbeat, node.lost and
# node.cordoned. Heartbeats are frequent, so a row is updated in place (no timeline row per
# beat). It keeps its own position (``nodes``) and follows ``dsec.node.>`` on its own, so the
# beats never delay the sandboxes' read models, and a rebuild of one leaves the other alone.

NODES = "nodes"

NODES_SCHEMA = """
CREATE TABLE IF NOT EXISTS projection_state (
    name text PRIMARY KEY,
    applied_seq bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS nodes (
    node_id text PRIMARY KEY,
    hostname text,
    version text,
    joined_at timestamptz,
    last_seen timestamptz NOT NULL,
    heartbeat_s double precision NOT NULL DEFAULT 5,
    seq bigint NOT NULL DEFAULT 0,
    inventory jsonb NOT NULL DEFAULT '{}',
    sandboxes jsonb NOT NULL DEFAULT '[]',
    problems jsonb NOT NULL DEFAULT '[]',
    cordoned boolean NOT NULL DEFAULT false,
    draining boolean NOT NULL DEFAULT false,
    cordon_reason text NOT NULL DEFAULT '',
    lost boolean NOT NULL DEFAULT false,
    lost_at timestamptz,
    last_seq bigint NOT NULL
);
"""

NODES_DROP = "DROP TABLE IF EXISTS nodes; DELETE FROM projection_state WHERE name = 'nodes';"

_NODE_SEEN = """
INSERT INTO nodes AS n (node_id, hostname, version, joined_at, last_seen, heartbeat_s, seq,
    inventory, sandboxes, problems, last_seq)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
ON CONFLICT (node_id) DO UPDATE SET
    hostname = COALESCE(EXCLUDED.hostname, n.hostname),
    version = COALESCE(EXCLUDED.version, n.version),
    joined_at = COALESCE(EXCLUDED.joined_at, n.joined_at),
    last_seen = GREATEST(EXCLUDED.last_seen, n.last_seen),
    heartbeat_s = EXCLUDED.heartbeat_s,
    seq = EXCLUDED.seq,
    inventory = EXCLUDED.inventory,
    sandboxes = EXCLUDED.sandboxes,
    problems = EXCLUDED.problems,
    lost = false,
    lost_at = NULL,
    last_seq = EXCLUDED.last_seq
WHERE n.last_seen IS NULL OR EXCLUDED.last_seen > n.last_seen
"""
# (the WHERE: a node event signed no later than the one shown, the bytes of an old heartbeat
# published again, is no sign of life: it neither clears `lost` nor brings back old values)


async def ensure_node_schema(conn: asyncpg.Connection) -> None:
    """Create the nodes table when missing (under :func:`ensure_schema`'s lock: both create
    ``projection_state``, and concurrent DDL of one table races)."""
    await end_stale_readers(conn, READER_MAX_TRANSACTION_S)
    async with conn.transaction():
        await conn.execute("SET LOCAL lock_timeout = '10s'")
        await conn.execute("SELECT pg_advisory_xact_lock(7271)")
        await conn.execute(NODES_SCHEMA)
        await conn.execute(grant_readers("projection_state", "nodes"))


async def apply_node_event(conn: asyncpg.Connection, seq: int, env: Envelope) -> None:
    """Apply one node event to the nodes table (call inside a transaction). A heartbeat or a
    join shows the node alive again (``lost`` cleared); cordon state is the scheduler's."""
    p, node_id = env.payload, str(env.payload.get("node_id") or env.aggregate_id)
    if env.type in ("node.joined", "node.heartbeat"):
        joined = env.type == "node.joined"
        await conn.execute(
            _NODE_SEEN,
            node_id,
            p.get("hostname"),
            p.get("version"),
            env.time if joined else None,
            env.time,
            float(p.get("heartbeat_s") or 5.0),
            int(p.get("seq") or 0),
            _json(p.get("inventory") or {}),
            _json(p.get("sandboxes") or []),
            _json(p.get("problems") or []),
            seq,
        )
    elif env.type == "node.lost":
        await conn.execute(
            "UPDATE nodes SET lost = true, lost_at = $2, last_seq = $3 WHERE node_id = $1",
            node_id,
            env.time,
            seq,
        )
    elif env.type == "node.cordoned":
        await conn.execute(
            "UPDATE nodes SET cordoned = $2, draining = $3, cordon_reason = $4, last_seq = $5"
            " WHERE node_id = $1",
            node_id,
            bool(p.get("cordoned")),
            bool(p.get("draining")),
            str(p.get("reason") or ""),
            seq,
        )


def _readable(env: Envelope, seq: int) -> bool:
    """Whether the payload is one its model accepts: a node agent's NaN CPUs or 10^30 bytes
    (refused by the model's bounds) is skipped, never left to stop the projection."""
    try:
        env.decoded()
    except ValueError as exc:
        log.warning("nodes projection skips unreadable %s at seq %d: %s", env.type, seq, exc)
        return False
    return True


async def apply_node_batch(
    conn: asyncpg.Connection, batch: Sequence[tuple[int, bytes]], gate: Gate | None = None
) -> int:
    """Apply a batch of node events and the new position in one transaction (only authentic,
    authorized ones with a ``gate``: a node agent cannot show another node alive)."""
    async with conn.transaction():
        current = int(
            await conn.fetchval("SELECT applied_seq FROM projection_state WHERE name = $1", NODES)
            or 0
        )
        for seq, data in batch:
            if seq <= current:
                continue
            try:
                env = decode(data) if gate is None else await gate.authentic(data)
            except MalformedEnvelope as exc:
                log.error("nodes projection skips malformed event at seq %d: %s", seq, exc)
                env = None
            if env is not None and env.aggregate == "node" and _readable(env, seq):
                await apply_node_event(conn, seq, env)
            elif env is None and gate is not None:
                log.warning("nodes projection skips unauthentic event at seq %d", seq)
            current = seq
        await conn.execute(
            "INSERT INTO projection_state (name, applied_seq) VALUES ($1, $2)"
            " ON CONFLICT (name) DO UPDATE SET applied_seq = EXCLUDED.applied_seq",
            NODES,
            current,
        )
    return current


@dataclass
class NodeProjector:
    """Keeps the nodes table up to date (run by :class:`Projector` beside the sandboxes)."""

    js: JetStreamContext
    dsn: str
    gate: Gate | None = None
    batch_size: int = 256

    async def run(self, stop: asyncio.Event) -> None:
        """Follow ``dsec.node.>`` until ``stop`` is set; retry after a failure with backoff."""
        delay = 0.5
        while not stop.is_set():
            try:
                await self._follow(stop)
                return
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("nodes projector: %s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _follow(self, stop: asyncio.Event) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:
            await ensure_node_schema(conn)
            start = (
                int(
                    await conn.fetchval(
                        "SELECT applied_seq FROM projection_state WHERE name = $1", NODES
                    )
                    or 0
                )
                + 1
            )
            batches = follow(
                self.js, start_seq=start, batch=self.batch_size, filter_subject=f"{ROOT}.node.>"
            )
            async for batch in until_set(stop, batches):
                if batch:
                    await apply_node_batch(conn, batch, self.gate)
        finally:
            await conn.close()


async def rebuild_nodes(js: JetStreamContext, dsn: str, gate: Gate | None = None) -> int:
    """Drop the nodes table and replay the node events into it; return the position."""
    conn = await asyncpg.connect(dsn)

    async def fill(conn: asyncpg.Connection) -> int:
        batch: list[tuple[int, bytes]] = []
        position = 0
        async for item in replay(js, filter_subject=f"{ROOT}.node.>"):
            batch.append(item)
            if len(batch) >= 512:
                position = await apply_node_batch(conn, batch, gate)
                batch = []
        if batch:
            position = await apply_node_batch(conn, batch, gate)
        return position

    try:
        await ensure_node_schema(conn)  # (NODES_DROP clears its row of projection_state)
        return await _rebuild(conn, NODES_DROP, ensure_node_schema, fill)
    finally:
        await conn.close()
