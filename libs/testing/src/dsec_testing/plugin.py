"""pytest plugin (entry point ``pytest11: dsec``): fixtures that start the embedded stack's real
servers on free ports in a temporary directory — the same code as ``dsec up``.

Session fixtures, each starting only the server it needs, on first request:

- ``nats_url`` (str): NATS with JetStream, as the operator (``nats://operator:PW@...``).
- ``postgres_dsn`` (str): PostgreSQL 18, user/db ``dsec``, password auth over TCP.
- ``s3`` (:class:`~dsec_testing.stack.S3Info`): SeaweedFS with real credentials, bucket created.
- ``vault`` (:class:`~dsec_testing.stack.VaultInfo`): OpenBao dev mode.
- ``stack_env`` (dict): ``DSEC_*`` variables for all four plus ``DSEC_HOME``; NATS as the local
  tenant's ``user`` (``DSEC_NATS_NKEY_SEED``), the identity the CLI has after ``dsec up``.

- ``dsec_cluster`` (:class:`~dsec_testing.stack.ClusterFixture`): a second stack with three
  nodes on this machine: three NATS servers in one JetStream cluster (the stream on R3;
  ``kill_nats``/``start_nats`` one member), and the three node agents on demand
  (``start_node_agents()``).

Function fixtures:

- ``nats_restart``: restart NATS on the same port and store (``kill=True`` for a crash).
- ``services``: start DSec services as processes against ``stack_env``; stop/kill/restart one.

Everything is stopped at session end; servers also die with the pytest process if it is killed.

Every test is also checked for one host-wide side effect that once broke a whole CI run much
later: the test after which ``/dev/null`` is no longer the null device fails (and the device
is put back, so the tests after it are not blamed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from dsec_testing.stack import (
        ClusterFixture,
        NatsRestarter,
        S3Info,
        ServiceRunner,
        StackFixture,
        VaultInfo,
    )


def _null_device_ok() -> bool:
    import os
    import stat

    try:
        st = os.lstat(os.devnull)
    except FileNotFoundError:
        return False
    return stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and os.minor(st.st_rdev) == 3


TEARDOWN_LIMIT_S = float(__import__("os").environ.get("DSEC_TEST_TEARDOWN_LIMIT_S", "240"))
"""How long the session's last teardown (its fixtures, the event loop's end) may take."""

_session_over = None
_REAL_STDERR = __import__("os").dup(2)  # before pytest captures fd 2: what the watchdog writes to


def _watch_teardown(done: object) -> None:
    """Once the last test ends: if the session has not finished ``TEARDOWN_LIMIT_S`` later,
    print every thread's stack and every unfinished asyncio task's, then exit 1 — a hang there
    (a task that never ends after cancellation keeps the loop's close waiting) would otherwise
    last until CI's own limit and say nothing."""
    import asyncio
    import faulthandler
    import gc
    import os
    import threading

    assert isinstance(done, threading.Event)
    if done.wait(TEARDOWN_LIMIT_S):
        return
    with os.fdopen(os.dup(_REAL_STDERR), "w") as out:
        out.write(f"\ndsec_testing: session teardown still going after {TEARDOWN_LIMIT_S:.0f} s\n")
        out.flush()
        faulthandler.dump_traceback(file=out)
        for obj in gc.get_objects():
            if isinstance(obj, asyncio.Task) and not obj.done():
                out.write(f"unfinished task {obj!r}\n")
                obj.print_stack(file=out)
        out.flush()
    os._exit(1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _session_over is not None:
        _session_over.set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Fail the test that replaced or removed ``/dev/null`` (e.g. an atomic write whose target
    was ``os.devnull``), then restore the device (as root). Before the last test's teardown
    (which ends the session's fixtures and event loop) a watchdog starts (``_watch_teardown``)."""
    global _session_over
    if nextitem is None and _session_over is None:
        import threading

        _session_over = threading.Event()
        threading.Thread(
            target=_watch_teardown, args=(_session_over,), name="dsec-teardown-watch", daemon=True
        ).start()
    result = yield
    if not _null_device_ok():
        import contextlib
        import os
        import stat

        if os.geteuid() == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.devnull)
            os.mknod(os.devnull, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            os.chmod(os.devnull, 0o666)
        pytest.fail(f"{item.nodeid} replaced or removed {os.devnull} (restored)", pytrace=False)
    return result


@pytest.fixture(scope="session")
def dsec_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackFixture]:
    """The session's embedded stack (servers start lazily; see the other fixtures)."""
    from dsec_testing.stack import StackFixture

    fixture = StackFixture(tmp_path_factory.mktemp("dsec-home"))
    try:
        yield fixture
    finally:
        fixture.discard()


@pytest.fixture(scope="session")
def dsec_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFixture]:
    """A stack of three nodes on this machine (its own home; servers start lazily, the three
    NATS servers together in about a second)."""
    from dsec_testing.stack import ClusterFixture

    fixture = ClusterFixture(tmp_path_factory.mktemp("dsec-cluster"), nodes=3)
    try:
        yield fixture
    finally:
        fixture.discard()


@pytest.fixture(scope="session")
def nats_url(dsec_stack: StackFixture) -> str:
    """URL of a NATS server with JetStream, with the operator's credentials
    (``nats://operator:PW@127.0.0.1:PORT``: every right, the stream already created)."""
    return dsec_stack.nats_url


@pytest.fixture(scope="session")
def postgres_dsn(dsec_stack: StackFixture) -> str:
    """DSN of PostgreSQL (``postgresql://dsec:PW@127.0.0.1:PORT/dsec``)."""
    return dsec_stack.postgres_dsn


@pytest.fixture(scope="session")
def s3(dsec_stack: StackFixture) -> S3Info:
    """The S3 server: ``endpoint``, ``access_key``, ``secret_key``, ``bucket``, ``client()``."""
    return dsec_stack.s3


@pytest.fixture(scope="session")
def vault(dsec_stack: StackFixture) -> VaultInfo:
    """OpenBao in dev mode: ``addr``, ``token``, ``client()`` (hvac)."""
    return dsec_stack.vault


@pytest.fixture(scope="session")
def stack_env(dsec_stack: StackFixture) -> dict[str, str]:
    """``DSEC_*`` variables pointing at NATS, Postgres, S3 and OpenBao, plus ``DSEC_HOME``."""
    return dsec_stack.env()


@pytest.fixture
def nats_restart(dsec_stack: StackFixture) -> NatsRestarter:
    """Call it to restart NATS on the same port and JetStream store (``await .arestart()`` in
    async tests; ``kill=True`` simulates a crash)."""
    from dsec_testing.stack import NatsRestarter

    dsec_stack.ensure("nats")
    return NatsRestarter(dsec_stack)


@pytest.fixture
def services(dsec_stack: StackFixture) -> Iterator[ServiceRunner]:
    """Start DSec services as processes (``services.start("policy")``); ``stop``/``kill``/
    ``restart`` one; all are stopped when the test ends."""
    from dsec_testing.stack import ServiceRunner

    runner = ServiceRunner(dsec_stack)
    try:
        yield runner
    finally:
        runner.close()
