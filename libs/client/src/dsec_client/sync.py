"""The synchronous twin: :class:`DSecSync` runs :class:`~dsec_client.DSec` on a private event
loop in a daemon thread, for scripts and notebooks that are not async::

    with DSecSync() as d:
        sb = d.submit("dsec.yaml", code=".")
        sb.wait("ready")
        print(sb.exec(["python", "-V"]).stdout)
        sb.stop()

Every method takes the same arguments as its async original and blocks until it is done;
iterators (:meth:`SandboxSync.events`, :meth:`DSecSync.events`) are ordinary iterators.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from dsec_core.events import BundleRef, Payload
from dsec_core.settings import Settings

from dsec_client.client import DSec, ExecResult, Sandbox, Since
from dsec_client.code import SpecLike
from dsec_client.events import Event

T = TypeVar("T")


class _Loop:
    """An event loop running in its own daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="dsec-client", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:  # Ctrl-C while waiting: stop the work on the loop too
            future.cancel()
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        async def step() -> tuple[bool, T | None]:
            try:
                return True, await agen.__anext__()
            except StopAsyncIteration:
                return False, None

        try:
            while True:
                more, item = self.run(step())
                if not more:
                    return
                yield item  # type: ignore[misc]  # ``more`` means an item came
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and self.loop.is_running():
                self.run(aclose())

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class DSecSync:
    """:class:`~dsec_client.DSec`, blocking. ``with DSecSync() as d:`` connects and closes."""

    def __init__(self, settings: Settings | None = None, **options: Any) -> None:
        self._loop = _Loop()
        self.aio = DSec(settings, **options)
        """The asynchronous client underneath."""

    def __enter__(self) -> DSecSync:
        try:
            self._loop.run(self.aio.connect())
        except BaseException:
            self._loop.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and stop the private loop."""
        try:
            if self._loop.loop.is_running():
                self._loop.run(self.aio.close())
        finally:
            self._loop.close()

    def submit(
        self,
        spec: SpecLike,
        code: str | os.PathLike[str] | BundleRef | None = None,
        *,
        filename: str | None = None,
        start_from_snapshot: str | None = None,
        also: Sequence[Payload] = (),
        handover_from: str | None = None,
    ) -> SandboxSync:
        """:meth:`DSec.submit`."""
        sandbox = self._loop.run(
            self.aio.submit(
                spec,
                code,
                filename=filename,
                start_from_snapshot=start_from_snapshot,
                also=also,
                handover_from=handover_from,
            )
        )
        return SandboxSync(self._loop, sandbox)

    def sandbox(self, sandbox_id: str) -> SandboxSync:
        """:meth:`DSec.sandbox`."""
        return SandboxSync(self._loop, self.aio.sandbox(sandbox_id))

    def events(
        self,
        type: str | Sequence[str] | None = None,
        *,
        since: Since = None,
        sandbox: str | None = None,
    ) -> Iterator[Event]:
        """:meth:`DSec.events`."""
        return self._loop.iterate(self.aio.events(type, since=since, sandbox=sandbox))


class SandboxSync:
    """:class:`~dsec_client.Sandbox`, blocking."""

    def __init__(self, loop: _Loop, sandbox: Sandbox) -> None:
        self._loop = loop
        self.aio = sandbox
        """The asynchronous sandbox underneath."""

    def __repr__(self) -> str:
        return repr(self.aio)

    @property
    def id(self) -> str:
        return self.aio.id

    @property
    def state(self) -> str:
        return self.aio.state

    def events(self, *, until_end: bool = True) -> Iterator[Event]:
        """:meth:`Sandbox.events`."""
        return self._loop.iterate(self.aio.events(until_end=until_end))

    def wait(self, until: str = "ready", **options: Any) -> Event:
        """:meth:`Sandbox.wait`."""
        return self._loop.run(self.aio.wait(until, **options))

    def logs(self, **options: Any) -> str:
        """:meth:`Sandbox.logs`."""
        return self._loop.run(self.aio.logs(**options))

    def exec(self, argv: Sequence[str], *, input: bytes | None = None) -> ExecResult:
        """:meth:`Sandbox.exec`."""
        return self._loop.run(self.aio.exec(argv, input=input))

    def snapshot(self, name: str, **options: Any) -> Event:
        """:meth:`Sandbox.snapshot`."""
        return self._loop.run(self.aio.snapshot(name, **options))

    def rollback(self, snapshot: str, **options: Any) -> Event:
        """:meth:`Sandbox.rollback`."""
        return self._loop.run(self.aio.rollback(snapshot, **options))

    def stop(self, **options: Any) -> int | None:
        """:meth:`Sandbox.stop`."""
        return self._loop.run(self.aio.stop(**options))

    def ended(self) -> Event | None:
        """:meth:`Sandbox.ended`."""
        return self._loop.run(self.aio.ended())
