"""Remote logs, exec and cp: ``dsec sandbox logs|exec|cp`` from any machine that reaches the bus.

The node agent listens on its own node's request subjects (``dsec_rpc.node.<node>.*``, core
NATS, outside the audited stream), verifies each request like an event (certificate from the
operator root, signature, a user of the sandbox's tenant, the replay window) and streams the
output back encrypted to the request's one-time key (protocol: :mod:`dsec_core.remote`).
Sessions are bounded: 16 per node, 32 KiB frames, 4 MiB/s each, ended when the client stops
sending keep-alives (10 s), when a followed sandbox has exited, or when the command ends.
An exec with a TTY runs on a pseudo-terminal made here (its size set at start and on each
``resize`` frame); a cp runs a confined copier in the sandbox (:mod:`.sandbox.transfer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from dsec_core import remote, rpc
from dsec_core.remote import FrameCodec, RemoteError, Request
from dsec_core.service import Service
from nacl.public import PrivateKey
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge

from dsec_nodeagent.sandbox import transfer
from dsec_nodeagent.sandbox.manager import SandboxManager

log = logging.getLogger(__name__)

_FORGED_INPUT = rpc.RefusalLog(log, "remote input of")
"""Forged frames on the input subject, one log line per 10 s at most (anyone who read a
session's hash may publish there)."""
REFUSALS = Counter(
    "dsec_remote_refusals_total", "Remote logs/exec requests refused", ["kind", "reason"]
)
SESSIONS = Gauge("dsec_remote_sessions", "Remote logs/exec sessions being served")


class _Gone(Exception):
    """The client went away, cancelled, or broke the protocol."""


class Session:
    """One verified request being served: output out, input in, both encrypted."""

    def __init__(
        self, request: Request, codec: FrameCodec, send: Callable[[bytes], Awaitable[None]]
    ):
        self.request = request
        self.codec = codec
        self._send = send
        self.bucket = remote.TokenBucket()
        self.last_heard = time.monotonic()
        self.last_sent = time.monotonic()
        self.stdin: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.stdin_bytes = 0
        self.task: asyncio.Task[None] | None = None
        self.ended = asyncio.Event()
        self.on_resize: Callable[[int, int], None] | None = None
        self.problem: str | None = None
        """Why the node ended the session (a cp over its limits), for the end frame."""
        self.fed = 0
        self.files = 0
        self.bytes = 0

    async def send(self, frame: dict[str, Any]) -> None:
        self.last_sent = time.monotonic()
        await self._send(self.codec.seal(frame))

    async def output(self, stream: str, data: bytes) -> None:
        for start in range(0, len(data), remote.CHUNK):
            piece = data[start : start + remote.CHUNK]
            wait = self.bucket.delay(len(piece))
            if wait > 0:
                await asyncio.sleep(wait)
            await self.send({"k": "out", "s": stream, "d": piece})

    def received(self, data: bytes) -> None:
        """A client frame (already routed by request id)."""
        try:
            frame = self.codec.open(data)
        except remote.ForgedFrame as exc:  # anyone may publish there: logged sparingly
            REFUSALS.labels("input", "forged").inc()
            _FORGED_INPUT.refused(f"{self.request.kind} {self.request.id}", "forged", str(exc))
            return
        except RemoteError as exc:
            log.warning("remote %s of %s: %s; ending it", self.request.kind, self.request.id, exc)
            self.cancel()
            return
        self.last_heard = time.monotonic()
        kind = frame.get("k")
        if kind == "cancel":
            self.cancel()
        elif kind == "stdin" and isinstance(frame.get("d"), bytes) and self.request.kind == "exec":
            self.stdin_bytes += len(frame["d"])
            self.stdin.put_nowait(frame["d"])
        elif kind == "eof":
            if self.request.tty:  # a terminal has no separate EOF: send what Ctrl-D sends
                self.stdin.put_nowait(b"\x04")
            elif self.request.kind == "cp":
                if self.request.args.get("op") == "put":
                    self._put_stdin(transfer.record(b"E"))
                    self.stdin.put_nowait(None)
            else:
                self.stdin.put_nowait(None)
        elif kind == "resize" and self.on_resize is not None:
            if remote.valid_size(frame.get("rows"), frame.get("cols")):
                self.on_resize(frame["rows"], frame["cols"])
        elif kind in ("entry", "data") and self.request.kind == "cp":
            self._copy_in(frame)

    def _put_stdin(self, data: bytes) -> None:
        self.stdin_bytes += len(data)
        self.stdin.put_nowait(data)

    def _copy_in(self, frame: dict[str, Any]) -> None:
        """A cp into the sandbox: the client's entry and data frames, checked and counted,
        become the copier's records."""
        if self.request.args.get("op") != "put":
            return
        try:
            if frame.get("k") == "data":
                data = frame.get("d")
                if not isinstance(data, bytes) or len(data) > remote.CHUNK:
                    raise RemoteError("a data frame without bytes, or over 32 KiB")
                self.bytes += len(data)
                if self.bytes > remote.CP_MAX_BYTES:
                    raise RemoteError(f"more than {remote.CP_MAX_BYTES} bytes")
                self._put_stdin(transfer.record(b"B", data))
                return
            kind = {"dir": b"D", "file": b"F"}.get(str(frame.get("t")))
            mode = frame.get("m")
            if kind is None or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
                raise RemoteError("an entry needs t (dir or file) and m (a mode)")
            path = remote.entry_path(frame.get("p"))
            self.files += 1
            if self.files > remote.CP_MAX_FILES:
                raise RemoteError(f"more than {remote.CP_MAX_FILES} files and directories")
            self._put_stdin(transfer.entry(kind, mode, path))
        except RemoteError as exc:
            self.problem = str(exc)
            self.cancel()

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


class RemoteAccess:
    """The node agent's side of remote logs and exec (one per node agent)."""

    def __init__(self, service: Service, manager: SandboxManager) -> None:
        self.service = service
        self.manager = manager
        self.node_id = service.settings.node_id
        self.replay = remote.TenantReplayWindows()
        self.sessions: dict[bytes, Session] = {}
        """By the hash of the request's bytes (another user's request may carry the same id)."""
        self._subs: list[Any] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._refusals = rpc.RefusalLog(log, "remote request")

    def attach(self) -> RemoteAccess:
        """Start and stop with the service."""
        self.service.on_start.append(self.start)
        self.service.on_stop.insert(0, self.stop)
        return self

    async def start(self) -> None:
        nc = self.service.nc
        assert nc is not None
        self.replay = remote.TenantReplayWindows()
        for kind in remote.KINDS:
            handler = self._handler(kind)
            self._subs.append(
                await nc.subscribe(remote.request_subject(self.node_id, kind), cb=handler)
            )
        self._subs.append(
            await nc.subscribe(remote.request_subject(self.node_id, "input"), cb=self._on_input)
        )
        self._watchdog = asyncio.create_task(self._watch(), name="remote-watchdog")

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for session in list(self.sessions.values()):
            session.cancel()
        tasks = [s.task for s in self.sessions.values() if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    # ------------------------------------------------------------------ requests

    def _handler(self, kind: str) -> Callable[[Msg], Awaitable[None]]:
        async def on_request(msg: Msg) -> None:
            try:
                await self._on_request(kind, msg)
            except Exception:  # a hostile request must never stop the node agent
                log.exception("remote %s request failed", kind)

        return on_request

    async def _on_request(self, kind: str, msg: Msg) -> None:
        # A refusal goes to the subject the message came with and names the hash of its exact
        # bytes: an altered copy of someone's request is refused to whoever sent it, and that
        # refusal is not one of the genuine request (the client checks the hash).
        rh = rpc.request_hash(msg.data)
        try:
            request = remote.parse_request(msg.data, kind)
        except RemoteError as exc:
            await self._refuse(kind, msg.reply, "-", rh, "malformed", str(exc))
            return
        problem = await self._verify(request, msg.reply)
        if problem is not None:
            await self._refuse(kind, msg.reply, request.id, rh, *problem)
            return
        await self._serve(request)

    async def _verify(self, request: Request, reply: str | None) -> tuple[str, str] | None:
        """Why the request must be refused, checked like an event; None when it may be served."""
        gate = self.service.gate
        assert gate is not None
        if request.node_id != self.node_id:
            return "misrouted", f"a request for node {request.node_id!r} on {self.node_id!r}"
        if reply != request.reply_to:
            return "malformed", "the reply subject is not the one the request signed"
        if not rpc.answerable(reply):
            return "malformed", "the reply subject is a service's inbox"
        outside = self.replay.outside(request.time)  # before the key is looked up in the log
        if outside is not None:
            return outside
        refused = await rpc.user_refusal(
            gate.keys, request.key_id, request.producer, request.tenant, request.fields,
            remote.REQUEST_DOMAIN, action="act",
        )  # fmt: skip
        if refused is not None:
            return refused
        replayed = self.replay.refusal(request.tenant, request.key_id, request.id, request.time)
        if replayed is not None:
            return replayed
        owner = await gate.tenant_of(request.sandbox_id)
        if owner is None:
            return "not-found", f"no sandbox {request.sandbox_id} in the event log"
        if owner != request.tenant:
            return "cross-tenant", f"sandbox {request.sandbox_id} belongs to another tenant"
        return self._here(request)

    def _here(self, request: Request) -> tuple[str, str] | None:
        """The sandbox is on this node, and running when a command is to run in it."""
        sid = request.sandbox_id
        if request.kind in ("exec", "cp"):
            state = self.manager.states.read(sid)
            if state is None or state.get("phase") != "running":
                return "not-running", f"no running sandbox {sid} on node {self.node_id}"
            if request.kind == "cp":
                problem = self._copy_refusal(request)
                if problem is not None:
                    return problem
        elif not self._log_path(request).exists():
            return "not-found", f"no logs of {sid} on node {self.node_id}"
        if len(self.sessions) >= remote.MAX_SESSIONS:
            return "busy", f"node {self.node_id} serves {remote.MAX_SESSIONS} sessions already"
        held = sum(1 for s in self.sessions.values() if s.request.tenant == request.tenant)
        if held >= remote.MAX_SESSIONS_PER_TENANT:
            return (
                "busy",
                f"tenant {request.tenant!r} has {held} sessions on node {self.node_id}, the most "
                f"one tenant may (of the node's {remote.MAX_SESSIONS}); end one (a `logs -f`, "
                "an exec) and ask again",
            )
        return None

    def _copy_refusal(self, request: Request) -> tuple[str, str] | None:
        """A cp outside the directories the sandbox's spec lets a copy use."""
        dirs = self.manager.copy_dirs(request.sandbox_id)
        if dirs is None:
            return "not-running", f"no running sandbox {request.sandbox_id} on {self.node_id}"
        path = remote.sandbox_path(request.args["path"])
        put = request.args["op"] == "put"
        where = dirs[1] if put else dirs[0]
        if not any(remote.under(path, d) for d in where):
            return (
                "not-allowed",
                f"{path} is outside the directories a copy may {'write' if put else 'read'} "
                f"in {request.sandbox_id}: {', '.join(where) or 'none'}",
            )
        return None

    def _log_path(self, request: Request) -> Path:
        return self.manager.log_paths(request.sandbox_id)[1 if request.stream == "stderr" else 0]

    async def _refuse(
        self, kind: str, reply: str | None, rid: str, rh: bytes, reason: str, detail: str
    ) -> None:
        REFUSALS.labels(kind, reason).inc()
        self._refusals.refused(f"{kind} {rid}", reason, detail)
        nc = self.service.nc
        if reply is not None and rpc.answerable(reply) and nc is not None:
            answer = remote.refusal(
                self.service.endorse, self.service.key_id, rid, rh, reason, detail
            )
            with contextlib.suppress(Exception):
                await nc.publish(reply, answer)

    # ------------------------------------------------------------------ sessions

    async def _serve(self, request: Request) -> None:
        nc = self.service.nc
        assert nc is not None
        hello, box = remote.hello(
            self.service.endorse, self.service.key_id, request, PrivateKey.generate()
        )

        async def send(data: bytes) -> None:
            await nc.publish(request.reply_to, data)

        session = Session(request, FrameCodec(box), send)
        self.sessions[request.hash] = session
        SESSIONS.set(len(self.sessions))
        await nc.publish(request.reply_to, hello)
        log.info(
            "remote %s of %s for %s (request %s)",
            request.kind, request.sandbox_id, request.producer, request.id,
        )  # fmt: skip
        session.task = asyncio.create_task(self._run(session), name=f"remote-{request.id}")

    async def _run(self, session: Session) -> None:
        end: dict[str, Any] = {"k": "end", "code": None, "reason": "done"}
        try:
            if session.request.kind == "logs":
                end["reason"] = await self._logs(session)
            elif session.request.kind == "cp":
                end.update(await self._copy(session))
            elif session.request.tty:
                end["code"] = await self._exec_tty(session)
            else:
                end["code"] = await self._exec(session)
        except asyncio.CancelledError:
            end["reason"] = session.problem or "cancelled"
        except _Gone as exc:
            end["reason"] = str(exc)
        except Exception as exc:
            log.exception("remote %s %s failed", session.request.kind, session.request.id)
            end["reason"] = f"failed: {type(exc).__name__}"
        finally:
            self.sessions.pop(session.request.hash, None)
            SESSIONS.set(len(self.sessions))
        with contextlib.suppress(Exception):
            await session.send(end)

    async def _logs(self, session: Session) -> str:
        request = session.request
        path = self._log_path(request)
        with open(path, "rb") as fh:
            while True:
                data = await asyncio.to_thread(fh.read, remote.CHUNK)
                if data:
                    await session.output(request.stream, data)
                    continue
                if not request.follow:
                    return "done"
                if self.manager.states.read(request.sandbox_id) is None:
                    rest = await asyncio.to_thread(fh.read)
                    await session.output(request.stream, rest)
                    return "exited"
                await asyncio.sleep(0.1)

    async def _exec(self, session: Session) -> int:
        request = session.request
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        for fd in (in_w, out_r, err_r):
            os.set_blocking(fd, False)
        child_ends = [in_r, out_w, err_w]
        pumps = [
            asyncio.create_task(self._pump(out_r, "stdout", session)),
            asyncio.create_task(self._pump(err_r, "stderr", session)),
        ]
        feeder = asyncio.create_task(self._feed(in_w, session))
        try:
            code = await self.manager.exec(
                request.sandbox_id, request.argv, stdin=in_r, stdout=out_w, stderr=err_w
            )
            for fd in child_ends:
                os.close(fd)
            child_ends.clear()
            # What the command wrote before it ended (a child it left behind may keep the
            # pipes open: its output is not waited for longer than this).
            await asyncio.wait(pumps, timeout=2.0)
            return code
        finally:
            for fd in child_ends:
                os.close(fd)
            for task in (*pumps, feeder):
                task.cancel()
            await asyncio.gather(*pumps, feeder, return_exceptions=True)
            for fd in (out_r, err_r):
                os.close(fd)

    async def _exec_tty(self, session: Session) -> int:
        """The exec on a pseudo-terminal: the command's stdin, stdout and stderr are its side
        (and its controlling terminal), output comes back as one stream, input goes in as
        typed (Ctrl-C reaches the command as the terminal's SIGINT)."""
        request = session.request
        master, child = os.openpty()
        self._resize(master, int(request.args["rows"]), int(request.args["cols"]))
        session.on_resize = lambda rows, cols: self._resize(master, rows, cols)
        writer = os.dup(master)
        for fd in (master, writer):
            os.set_blocking(fd, False)
        pump = asyncio.create_task(self._pump(master, "stdout", session))
        feeder = asyncio.create_task(self._feed(writer, session))
        term = request.args.get("term")
        try:
            code = await self.manager.exec(
                request.sandbox_id, request.argv, stdin=child, stdout=child, stderr=child,
                env={"TERM": str(term or "xterm")}, tty=True,
            )  # fmt: skip
            os.close(child)
            child = -1
            await asyncio.wait([pump], timeout=2.0)
            return code
        finally:
            session.on_resize = None
            if child >= 0:
                os.close(child)
            for task in (pump, feeder):
                task.cancel()
            await asyncio.gather(pump, feeder, return_exceptions=True)
            os.close(master)

    @staticmethod
    def _resize(fd: int, rows: int, cols: int) -> None:
        with contextlib.suppress(OSError):
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    async def _copy(self, session: Session) -> dict[str, Any]:
        """``dsec sandbox cp``: a copier confined like an exec; what it sends is checked and
        counted (it runs as the sandbox: untrusted), and the end says how much moved."""
        request = session.request
        dirs = self.manager.copy_dirs(request.sandbox_id)
        if dirs is None:
            raise _Gone("the sandbox is no longer running")
        spec = {
            "op": request.args["op"],
            "path": remote.sandbox_path(request.args["path"]),
            "name": str(request.args.get("name", "")),
            "read_dirs": dirs[0],
            "write_dirs": dirs[1],
            "max_bytes": remote.CP_MAX_BYTES,
            "max_files": remote.CP_MAX_FILES,
        }
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        for fd in (in_w, out_r):
            os.set_blocking(fd, False)
        if spec["op"] == "get":
            os.close(in_w)
            in_w = -1
        child_ends = [in_r, out_w]
        reader = asyncio.create_task(self._copy_out(out_r, session))
        feeder = asyncio.create_task(self._feed(in_w, session)) if in_w >= 0 else None
        try:
            code = await self.manager.exec(
                request.sandbox_id, ["dsec-cp"], stdin=in_r, stdout=out_w,
                stderr=asyncio.subprocess.DEVNULL, transfer=spec,
            )  # fmt: skip
            for fd in child_ends:
                os.close(fd)
            child_ends.clear()
            done, _ = await asyncio.wait([reader], timeout=2.0)
            problem = reader.result() if reader in done else "the copier did not finish"
        finally:
            for fd in child_ends:
                os.close(fd)
            tasks = [t for t in (reader, feeder) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            os.close(out_r)
        if not problem and (problem == "" or code != 0):
            problem = f"the copier ended without its result (exit status {code})"
        result = {"files": session.files, "bytes": session.bytes}
        if problem is not None:
            return {**result, "code": 1, "reason": problem}
        return {**result, "code": 0, "reason": "done"}

    async def _copy_out(self, fd: int, session: Session) -> str | None:
        """Read the copier's records; a get's entries and bytes go to the client. Returns what
        went wrong (the copier's E record, or a malformed stream), None when all went well, ""
        when the copier ended without an E record."""
        loop = asyncio.get_running_loop()
        records = transfer.Reader()
        get = session.request.args.get("op") == "get"
        while True:
            ready = loop.create_future()
            loop.add_reader(fd, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(fd)
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                return ""  # no E record: the caller names the exit status
            try:
                for kind, payload in records.feed(data):
                    if kind == b"E":
                        return payload.decode(errors="replace") or None
                    if get:
                        await self._copy_frame(session, kind, payload)
            except transfer.TransferError as exc:  # malformed, or over a limit
                return str(exc)

    async def _copy_frame(self, session: Session, kind: bytes, payload: bytes) -> None:
        if kind == b"B":
            session.bytes += len(payload)
            if session.bytes > remote.CP_MAX_BYTES:
                raise transfer.TransferError(f"more than {remote.CP_MAX_BYTES} bytes")
            wait = session.bucket.delay(len(payload))
            if wait > 0:
                await asyncio.sleep(wait)
            await session.send({"k": "data", "d": payload})
        elif kind == b"X":
            path = transfer.relative(payload.decode(errors="replace"))
            await session.send({"k": "entry", "t": "skip", "p": path})
        else:
            mode, path = transfer.parse_entry(payload)
            session.files += 1
            if session.files > remote.CP_MAX_FILES:
                raise transfer.TransferError(f"more than {remote.CP_MAX_FILES} files")
            kind_name = "dir" if kind == b"D" else "file"
            await session.send({"k": "entry", "t": kind_name, "p": path, "m": mode})

    async def _pump(self, fd: int, stream: str, session: Session) -> None:
        """Copy one of the command's outputs to the client; the pipe stays unread (and the
        command waits) while the session's rate budget is spent."""
        loop = asyncio.get_running_loop()
        while True:
            ready = loop.create_future()
            loop.add_reader(fd, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(fd)
            try:
                data = os.read(fd, remote.CHUNK)
            except BlockingIOError:
                continue
            except OSError as exc:  # a terminal whose every other end closed: its EOF
                if exc.errno == errno.EIO:
                    return
                raise
            if not data:
                return
            await session.output(stream, data)

    async def _feed(self, fd: int, session: Session) -> None:
        """Write the client's input to the command's stdin; EOF closes it."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await session.stdin.get()
                if data is None:
                    return
                view = memoryview(data)
                while view:
                    try:
                        written = os.write(fd, view)
                        view = view[written:]
                        session.stdin_bytes -= written
                    except BlockingIOError:
                        ready = loop.create_future()
                        loop.add_writer(fd, ready.set_result, None)
                        try:
                            await ready
                        finally:
                            loop.remove_writer(fd)
                if session.request.kind == "cp":  # the client sends CP_WINDOW frames ahead
                    session.fed += 1
                    await session.send({"k": "ack", "n": session.fed})
        except BrokenPipeError:
            return
        finally:
            os.close(fd)

    async def _on_input(self, msg: Msg) -> None:
        try:
            rh, sealed = remote.parse_input(msg.data)
        except RemoteError:
            REFUSALS.labels("input", "malformed").inc()
            return
        session = self.sessions.get(rh)
        if session is None:
            return  # ended, or never ours: nothing to tell anyone
        session.received(sealed)
        if session.stdin_bytes > remote.MAX_STDIN_BUFFER:
            log.warning(
                "remote exec %s: input not read by the command; ending it", session.request.id
            )
            session.cancel()

    async def _watch(self) -> None:
        """End sessions whose client went quiet; keep the quiet ones' clients informed."""
        while True:
            await asyncio.sleep(remote.ALIVE_S / 2)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_heard > remote.GONE_S:
                    log.info("remote %s: the client went away", session.request.id)
                    session.cancel()
                elif now - session.last_sent > remote.ALIVE_S:
                    with contextlib.suppress(Exception):
                        await session.send({"k": "alive"})
