"""The CLI's side of remote logs and exec: output sinks and stdin; the protocol client (owning
node, signed request, the node's signed hello, the encrypted stream) is
:mod:`dsec_client.remote` (protocol: :mod:`dsec_core.remote`).
"""

from __future__ import annotations

import asyncio
import codecs
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

from dsec_client.remote import Driver, Ended, Send
from dsec_core import remote
from dsec_core.remote import Kind
from dsec_core.text import escape_controls

from dsec_cli.common import client


class Sink:
    """Where output goes: the raw bytes when piped; on a terminal, text with the control
    characters the sandbox wrote shown escaped (line breaks kept)."""

    def __init__(self, out: BinaryIO, *, terminal: bool) -> None:
        self.out = out
        self.terminal = terminal
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, data: bytes, *, final: bool = False) -> None:
        if self.terminal:
            text = self._decoder.decode(data, final=final)
            data = "\n".join(escape_controls(line) for line in text.split("\n")).encode()
        if data:
            self.out.write(data)
            self.out.flush()


def _stdin_reader(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[bytes | None]) -> None:
    """Read this process's stdin in a daemon thread (a terminal may never give EOF; the
    process must still be able to exit when the command ends)."""
    import sys

    source = getattr(sys.stdin, "buffer", None)

    def pump() -> None:
        try:
            while source is not None:
                read = getattr(source, "read1", source.read)
                data = read(remote.CHUNK)
                if not data:
                    break
                loop.call_soon_threadsafe(queue.put_nowait, data)
        except (OSError, ValueError):
            pass
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=pump, name="dsec-stdin", daemon=True).start()


async def session(
    kind: Kind,
    sandbox_id: str,
    args: dict[str, Any],
    on_output: Callable[[str, bytes], None],
    *,
    forward_stdin: bool = False,
    driver: Driver | None = None,
    on_frame: Callable[[dict[str, Any]], Any] | None = None,
) -> Ended:
    """Ask the sandbox's node agent for its logs (``kind="logs"``), to run a command
    (``"exec"``) or to copy files (``"cp"``); output goes to ``on_output(stream, bytes)`` as
    it arrives; ``driver`` and ``on_frame``: see :func:`dsec_client.remote.session`."""

    def stdin(queue: asyncio.Queue[bytes | None]) -> None:
        _stdin_reader(asyncio.get_running_loop(), queue)

    async with client() as d:
        sandbox = d.sandbox(sandbox_id)
        return await sandbox.session(
            kind,
            args,
            on_output,
            stdin=stdin if forward_stdin else None,
            driver=driver,
            on_frame=on_frame,
        )


__all__ = ["Ended", "Send", "Sink", "session"]
