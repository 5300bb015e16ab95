"""Users read the read models as a role that can only read them: the CLI's `sandbox list/show`
and `node ls` connect as `dsec_reader` (the DSN `dsec up` records), which may SELECT the
projected tables and nothing else, whatever the session asks for."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest
from dsec_core.projections import (
    READER_CHECK_S,
    end_stale_readers,
    ensure_node_schema,
    ensure_schema,
    restore_reader,
)

pytestmark = pytest.mark.integration


async def _prepared(dsec_stack: Any) -> str:
    """The read DSN, once the projectors' tables exist (created by the stack's own user, as
    the scheduler's projectors create them)."""
    conn = await asyncpg.connect(dsec_stack.postgres_dsn)
    try:
        await ensure_schema(conn)
        await ensure_node_schema(conn)
    finally:
        await conn.close()
    read_dsn = dsec_stack.stack.state.postgres_read_dsn
    assert read_dsn and "dsec_reader:" in read_dsn and read_dsn != dsec_stack.postgres_dsn
    return str(read_dsn)


async def test_the_read_role_reads_the_read_models_and_writes_nothing(dsec_stack: Any) -> None:
    read_dsn = await _prepared(dsec_stack)
    conn = await asyncpg.connect(read_dsn)
    try:
        for table in ("sandboxes", "sandbox_events", "specs", "nodes", "projection_state"):
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") >= 0
        # the session's own read-only switch is not what stops it: its privileges are
        await conn.execute("SET default_transaction_read_only = off")
        refused = [
            "INSERT INTO projection_state VALUES ('forged', 1)",
            "UPDATE sandboxes SET state = 'ready'",
            "DELETE FROM nodes",
            "TRUNCATE sandbox_events",
            "DROP TABLE specs",
            "ALTER TABLE sandboxes ADD COLUMN x int",
            "CREATE TABLE mine (x int)",
            "CREATE TEMP TABLE mine (x int)",
            "SELECT rolpassword FROM pg_authid",
            "CREATE ROLE other LOGIN",
            "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
            # the projectors' and `dsec up`'s advisory locks, held to stall them
            "SELECT pg_advisory_lock(7271)",
            "SELECT pg_try_advisory_xact_lock(7272)",
            "SELECT pg_advisory_lock_shared(1, 2)",
            # writes that need no table: a large object, a WAL message
            "SELECT lo_from_bytea(0, 'x'::bytea)",
            "SELECT pg_logical_emit_message(false, 'p', 'x')",
        ]
        done = []
        for sql in refused:
            try:
                await conn.execute(sql)
            except asyncpg.InsufficientPrivilegeError:
                continue
            done.append(sql)
        assert done == []
        # a GRANT of what it does not own is only a warning in Postgres: nothing is granted
        await conn.execute("GRANT INSERT ON sandboxes TO dsec_reader")
        assert not await conn.fetchval("SELECT has_table_privilege('sandboxes', 'INSERT')")
        with pytest.raises(asyncpg.PostgresError):  # neither a role of more rights
            await conn.execute("SET ROLE dsec")
    finally:
        await conn.close()
    # a new session is read-only from its first statement, as the role says
    conn = await asyncpg.connect(read_dsn)
    try:
        assert await conn.fetchval("SHOW default_transaction_read_only") == "on"
        assert await conn.fetchval("SHOW statement_timeout") == "30s"
    finally:
        await conn.close()


async def test_a_rebuilt_read_model_is_readable_again(dsec_stack: Any) -> None:
    """`dsec projections rebuild` drops and recreates the tables: the grant comes back."""
    read_dsn = await _prepared(dsec_stack)
    owner = await asyncpg.connect(dsec_stack.postgres_dsn)
    try:
        async with owner.transaction():
            await owner.execute("SELECT pg_advisory_xact_lock(7271)")
            await owner.execute("DROP TABLE nodes; DELETE FROM projection_state WHERE name='nodes'")
        await ensure_node_schema(owner)
    finally:
        await owner.close()
    conn = await asyncpg.connect(read_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM nodes") == 0
    finally:
        await conn.close()


async def test_the_cli_reads_as_the_read_role(
    dsec_stack: Any, dsec_cli: Any, stack_env: dict[str, str]
) -> None:
    """With the read DSN alone (a user's setting: the stack's own DSN is wrong here), the read
    commands work; with neither set, the CLI says what to set."""
    read_dsn = await _prepared(dsec_stack)
    env = {
        **stack_env,
        "DSEC_POSTGRES_READ_DSN": read_dsn,
        "DSEC_POSTGRES_DSN": "postgresql://dsec:wrong@127.0.0.1:1/dsec",
    }
    for args in (("sandbox", "list", "--json"), ("node", "ls", "--json")):
        out = await asyncio.to_thread(dsec_cli, *args, env=env)
        assert out.exit_code == 0, out.output
        assert isinstance(out.last_json(), list)
    missing = f"sbx_{uuid.uuid4().hex[:12]}"
    out = await asyncio.to_thread(dsec_cli, "sandbox", "show", missing, env=env)
    assert out.exit_code != 0 and missing in out.output
    # a DSN the environment names is never traded for stack.json's: it fails, and says so
    del env["DSEC_POSTGRES_READ_DSN"]
    out = await asyncio.to_thread(dsec_cli, "sandbox", "list", env=env)
    assert out.exit_code == 3 and "cannot reach PostgreSQL" in out.output


async def test_no_other_database_takes_the_reader(dsec_stack: Any) -> None:
    """`postgres` and `template1` took any role's connections (and its temporary tables)."""
    read_dsn = await _prepared(dsec_stack)
    for database in ("postgres", "template1"):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await asyncpg.connect(read_dsn, database=database)


async def test_a_readers_open_transaction_holds_no_projector(dsec_stack: Any) -> None:
    """A reader's transaction left open (it holds a lock on the tables, and vacuum's horizon):
    the projectors' schema check still goes through, and their watch ends it."""
    read_dsn = await _prepared(dsec_stack)
    reader = await asyncpg.connect(read_dsn)
    owner = await asyncpg.connect(dsec_stack.postgres_dsn)
    try:
        await reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await reader.fetchval("SELECT count(*) FROM sandboxes")
        await reader.fetchval("SELECT count(*) FROM nodes")
        await asyncio.wait_for(ensure_schema(owner), 10)  # (an ALTER waited here for ever)
        await asyncio.wait_for(ensure_node_schema(owner), 10)
        pid = reader.get_server_pid()
        assert await end_stale_readers(owner, 0) >= 1
        gone = "SELECT count(*) FROM pg_stat_activity WHERE pid = $1"
        assert await owner.fetchval(gone, pid) == 0  # its session was ended
    finally:
        await owner.close()
        reader.terminate()


async def test_dsec_up_takes_back_what_the_role_was_given(dsec_stack: Any) -> None:
    """Whoever held the stack's own DSN (every CLI user, before the read role) could have
    given the role more: the next `dsec up` brings it back to reading only."""
    from dsec_cli.stack import domain
    from dsec_cli.stack.adapters import probes

    read_dsn = await _prepared(dsec_stack)
    owner = await asyncpg.connect(dsec_stack.postgres_dsn)
    try:
        await owner.execute("GRANT dsec TO dsec_reader")
        await owner.execute("GRANT INSERT ON sandboxes TO dsec_reader")
        await owner.execute("GRANT CREATE ON SCHEMA public TO dsec_reader")
        await owner.execute("ALTER ROLE dsec_reader SET default_transaction_read_only = off")
    finally:
        await owner.close()
    reader = await asyncpg.connect(read_dsn)
    try:  # what a holder of the role may set for every user of it, per database too
        await reader.execute("ALTER ROLE dsec_reader IN DATABASE dsec SET lock_timeout = '1ms'")
    finally:
        await reader.close()
    password = dsec_stack.stack.state.servers["postgres"].credentials["reader_password"]
    await asyncio.to_thread(
        probes.postgres_ensure_reader,
        dsec_stack.postgres_dsn, domain.POSTGRES_READ_ROLE, password,
    )  # fmt: skip
    conn = await asyncpg.connect(read_dsn)
    try:
        assert await conn.fetchval("SHOW default_transaction_read_only") == "on"
        assert await conn.fetchval("SHOW lock_timeout") == "0"
        assert await conn.fetchval("SELECT count(*) FROM sandboxes") >= 0  # still reads
        await conn.execute("SET default_transaction_read_only = off")
        for sql in (
            "SET ROLE dsec",
            "INSERT INTO projection_state VALUES ('forged', 1)",
            "CREATE TABLE mine (x int)",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(sql)
    finally:
        await conn.close()


async def _alive(conn: asyncpg.Connection) -> bool:
    try:
        await conn.fetchval("SELECT 1", timeout=5)
        return True
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
        return False


async def test_a_reader_that_changes_its_password_or_defaults_has_them_set_back(
    dsec_stack: Any, services: Any
) -> None:
    """Any role may change its own password and session defaults: one user holding the shared
    read DSN locked every other user out (or gave their sessions a 1 ms lock timeout) until
    the next `dsec up`. The projectors set both back within seconds."""
    read_dsn = await _prepared(dsec_stack)
    owner = await asyncpg.connect(dsec_stack.postgres_dsn)
    try:
        assert await restore_reader(owner) == []  # as `dsec up` left it: nothing to set back
        await asyncio.to_thread(services.start, "scheduler")  # its projectors watch the role
        reader = await asyncpg.connect(read_dsn)
        try:
            await reader.execute("SET default_transaction_read_only = off")
            await reader.execute("ALTER ROLE dsec_reader PASSWORD 'only-mine-now'")
            await reader.execute("ALTER ROLE dsec_reader SET lock_timeout = '1ms'")
            await reader.execute(
                "ALTER ROLE dsec_reader IN DATABASE dsec SET statement_timeout = '1ms'"
            )
            # and holds the role's catalog row: an ALTER ROLE in a transaction left open (the
            # restore waited on it for ever, and nothing ended the transaction)
            await reader.execute("SET idle_in_transaction_session_timeout = 0")
            await reader.execute("BEGIN")
            await reader.execute("ALTER ROLE dsec_reader SET work_mem = '8MB'")
        except BaseException:
            await reader.close()
            raise
        with pytest.raises(asyncpg.InvalidPasswordError):
            await (await asyncpg.connect(read_dsn)).close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 4 * READER_CHECK_S + 10
        while True:
            try:
                conn = await asyncpg.connect(read_dsn)
                break
            except asyncpg.InvalidPasswordError:
                assert loop.time() < deadline, "the read role's password was never set back"
                await asyncio.sleep(0.2)
        try:  # password and defaults are set back in one transaction
            assert await conn.fetchval("SHOW lock_timeout") == "0"
            assert await conn.fetchval("SHOW statement_timeout") == "30s"
            assert await conn.fetchval("SHOW default_transaction_read_only") == "on"
        finally:
            await conn.close()
        assert "dsec_reader's ['password', 'settings'] had been changed" in services.log(
            "scheduler"
        )
        assert reader.is_closed() or not await _alive(reader)  # its session was ended
        reader.terminate()
    finally:
        await restore_reader(owner)  # whatever happened above, the next tests read as before
        await owner.close()


async def test_a_rebuild_is_not_held_by_readers(
    dsec_stack: Any, dsec_cli: Any, stack_env: dict[str, str]
) -> None:
    """`dsec projections rebuild` drops the tables: a reader's open transaction (it held the
    DROP, and every write and read queued behind it) is ended, and the rebuild goes through."""
    read_dsn = await _prepared(dsec_stack)
    reader = await asyncpg.connect(read_dsn)
    try:
        await reader.execute("BEGIN")
        await reader.fetchval("SELECT count(*) FROM sandboxes")
        await reader.fetchval("SELECT count(*) FROM nodes")
        pid = reader.get_server_pid()
        out = await asyncio.wait_for(
            asyncio.to_thread(dsec_cli, "projections", "rebuild", "--json", env=stack_env), 120
        )
        assert out.exit_code == 0, out.output
    finally:
        reader.terminate()
    owner = await asyncpg.connect(dsec_stack.postgres_dsn)
    try:
        assert (
            await owner.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid) == 0
        )
    finally:
        await owner.close()


def test_a_dsn_that_is_not_one_is_named_not_shown(dsec_cli: Any, tmp_path: Any) -> None:
    env = {"DSEC_HOME": str(tmp_path), "DSEC_POSTGRES_READ_DSN": "dsec_reader:s3cret@db:5432"}
    out = dsec_cli("sandbox", "list", env=env)
    assert out.exit_code == 2, out.output
    assert "DSEC_POSTGRES_READ_DSN is not a PostgreSQL DSN: expected postgresql://" in out.output
    assert "s3cret" not in out.output
