"""Record and replay of an agent's calls (docs/experiments.md): a layer around any call.

The layer sees a call as a :class:`CallKey` (what was asked) and a ``live`` function (how to ask
it for real), and answers with the call's response as **bytes**:

* :class:`Recorder` calls ``live()``, appends ``(key, response)`` to the sandbox's recording
  file (``$DSEC_RECORD_FILE``) and returns the response unchanged;
* :class:`Replayer` never calls ``live``: it returns the response recorded for the key
  (byte-for-byte), the n-th identical call getting the n-th recorded answer, and raises
  :class:`ReplayMiss` for a call the recording does not hold (VCR's ``none`` mode);
* :class:`Passthrough` just calls ``live()``.

Interface (what a tool-call pipeline slots in)::

    layer = active_layer()                         # from the environment; Passthrough if none
    body: bytes = layer.call_sync(key, live)       # or: await layer.call(key, alive)

``live`` returns the call's outcome as bytes (for a tool: :func:`encode_result` or
:func:`encode_error`, so a recorded error is raised again on replay); ``failed`` (optional)
tells which outcomes are failures (:func:`is_error`). Put the layer closest to the transport,
under retries, breakers and fallbacks: each attempt is then a call of its own, recorded in
order, and a replay goes through the same attempts. ``DSecClient`` picks the layer when it is
made and sends ``call_tool`` / ``acall_tool`` through it only when recording or replaying.

The key's :meth:`CallKey.digest` is the BLAKE3 hash of its canonical encoding: ``kind``
(``tool`` or ``http``), ``target`` (the agent called, or ``host:port``), ``name`` (the tool, or
``METHOD /path?query``), ``body`` (the tool's arguments in canonical MessagePack: maps with sorted
keys; or the HTTP request body as sent) and ``headers`` (for HTTP: only ``content-type`` and
``accept``, lower-cased; never credentials, dates or tracing ids, so a replayed call matches
although its API key or trace id differs). The timeout of a tool call is not in the key.

The node agent turns the recording file into an encrypted, content-addressed recording in S3
when the sandbox ends (``recording.saved``) and, for a sandbox started with ``replay:``, writes
the recorded calls to ``$DSEC_REPLAY_FILE`` (read-only) before the agent starts.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import blake3
import msgpack

ENV_RECORD: Final = "DSEC_RECORD_FILE"
"""Where the SDK appends the calls it records (set by the node agent for ``record.tools``)."""
ENV_REPLAY: Final = "DSEC_REPLAY_FILE"
"""The recorded calls a replaying sandbox is answered from (set by the node agent)."""
KEY_VERSION: Final = 1
HTTP_KEY_HEADERS: Final = ("accept", "content-type")
"""The only HTTP request headers in a call's key (lower-case)."""

CallKind = Literal["tool", "http"]


class ReplayMiss(LookupError):
    """A replaying sandbox made a call its recording does not hold (never made live)."""

    def __init__(self, key: CallKey, served: int) -> None:
        self.key = key
        self.served = served
        more = f" (its {served} recorded answer(s) were already served)" if served else ""
        super().__init__(
            f"no recorded answer for {key.kind} call {key.describe()} [key {key.digest()[:16]}]"
            f"{more}: replay never makes a live call; record a session that makes it"
        )


def canonical(value: Any) -> Any:
    """``value`` with every mapping's keys sorted (recursively), tuples as lists."""
    if isinstance(value, Mapping):
        return {str(k): canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    return value


def pack_canonical(value: Any) -> bytes:
    """Canonical MessagePack of ``value`` (sorted map keys; bytes stay bytes)."""
    packed: bytes = msgpack.packb(canonical(value), use_bin_type=True)
    return packed


@dataclass(frozen=True)
class CallKey:
    """What identifies a call for replay (see the module doc for what is in it)."""

    kind: CallKind
    target: str
    name: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    def canonical(self) -> bytes:
        """The bytes the digest is taken over."""
        return pack_canonical(
            [KEY_VERSION, self.kind, self.target, self.name, self.body, list(self.headers)]
        )

    def digest(self) -> str:
        """BLAKE3 hex of :meth:`canonical`."""
        return blake3.blake3(self.canonical()).hexdigest()

    def describe(self) -> str:
        return f"{self.target}.{self.name}" if self.kind == "tool" else f"{self.name} {self.target}"


def tool_key(agent: str, tool: str, arguments: Mapping[str, Any]) -> CallKey:
    """The key of a tool call (``agent``'s ``tool`` with ``arguments``; the timeout is not in)."""
    return CallKey("tool", agent, tool, pack_canonical(dict(arguments)))


def http_key(
    method: str, host: str, port: int, target: str, headers: Iterable[tuple[str, str]], body: bytes
) -> CallKey:
    """The key of an HTTP request (``target``: the request line's path and query)."""
    kept = sorted(
        (name.lower(), value.strip()) for name, value in headers if name.lower() in HTTP_KEY_HEADERS
    )
    return CallKey("http", f"{host}:{port}", f"{method.upper()} {target}", body, tuple(kept))


@dataclass
class Entry:
    """One recorded call: its key, the request's canonical bytes, the response, whether it
    failed (a tool's error, an HTTP status >= 400), and the n-th time this key was called."""

    key: CallKey
    response: bytes
    failed: bool = False
    seq: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.key.digest(),
            "kind": self.key.kind,
            "target": self.key.target,
            "name": self.key.name,
            "body": base64.b64encode(self.key.body).decode(),
            "headers": [list(h) for h in self.key.headers],
            "response": base64.b64encode(self.response).decode(),
            "failed": self.failed,
            "seq": self.seq,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        key = CallKey(
            kind=data["kind"],
            target=str(data["target"]),
            name=str(data["name"]),
            body=base64.b64decode(data.get("body", "")),
            headers=tuple((str(a), str(b)) for a, b in data.get("headers", [])),
        )
        digest = data.get("digest")
        if digest is not None and digest != key.digest():
            raise ValueError(f"recorded call {key.describe()}: digest does not match its key")
        return cls(
            key,
            base64.b64decode(data["response"]),
            bool(data.get("failed")),
            int(data.get("seq", 0)),
        )


def read_entries(path: Path) -> list[Entry]:
    """The entries of a recording file (JSON lines); a torn last line is ignored."""
    return parse_entries(path.read_text() if path.exists() else "", str(path))


def parse_entries(text: str, where: str) -> list[Entry]:
    """The entries of a recording's text (JSON lines, from ``where``); a torn last line is
    ignored."""
    return list(iter_entries(text.split("\n"), where))


def iter_entries(lines: Iterable[str | bytes], where: str) -> Iterator[Entry]:
    """The entries of a recording's lines (JSON lines, from ``where``), one at a time: a file
    is read line by line, never whole. A line that is not a recorded call is an error unless
    it is the last one (torn: a writer that died mid-write)."""
    torn: str | None = None
    for number, line in enumerate(lines, 1):
        if torn is not None:  # a bad line with more after it
            raise ValueError(torn)
        if not line.strip():
            continue
        try:
            entry = Entry.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            torn = f"{where}:{number}: not a recorded call: {exc}"
            continue
        yield entry


class Layer(Protocol):
    """A record/replay layer: answer ``key`` (with ``live`` when it may)."""

    def call_sync(
        self, key: CallKey, live: Callable[[], bytes], failed: FailedOf = ...
    ) -> bytes: ...

    async def call(
        self, key: CallKey, live: Callable[[], Awaitable[bytes]], failed: FailedOf = ...
    ) -> bytes: ...


FailedOf = Callable[[bytes], bool]


def _never(_: bytes) -> bool:
    return False


class Passthrough:
    """No recording, no replay: every call is live."""

    mode: Final = "live"

    def call_sync(
        self, key: CallKey, live: Callable[[], bytes], failed: FailedOf = _never
    ) -> bytes:
        return live()

    async def call(
        self, key: CallKey, live: Callable[[], Awaitable[bytes]], failed: FailedOf = _never
    ) -> bytes:
        return await live()


@dataclass
class Recorder:
    """Makes every call live and appends it to ``path`` (one JSON line per call, flushed)."""

    path: Path
    mode: Final = "record"
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seen: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def _append(self, key: CallKey, response: bytes, failed: bool) -> None:
        digest = key.digest()
        with self._lock:
            seq = self._seen[digest]
            self._seen[digest] = seq + 1
            line = json.dumps(Entry(key, response, failed, seq).to_json(), separators=(",", ":"))
            with self.path.open("a") as out:
                out.write(line + "\n")

    def call_sync(
        self, key: CallKey, live: Callable[[], bytes], failed: FailedOf = _never
    ) -> bytes:
        response = live()
        self._append(key, response, failed(response))
        return response

    async def call(
        self, key: CallKey, live: Callable[[], Awaitable[bytes]], failed: FailedOf = _never
    ) -> bytes:
        response = await live()
        self._append(key, response, failed(response))  # a small local append
        return response


class Replayer:
    """Answers calls from recorded entries only; ``live`` is never called."""

    mode: Final = "replay"

    def __init__(self, entries: Iterable[Entry]) -> None:
        self._answers: dict[str, deque[bytes]] = defaultdict(deque)
        self._served: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        for entry in sorted(entries, key=lambda e: e.seq):
            self._answers[entry.key.digest()].append(entry.response)
        self.misses: list[CallKey] = []

    @classmethod
    def from_file(cls, path: Path) -> Replayer:
        return cls(read_entries(path))

    def answer(self, key: CallKey) -> bytes:
        """The next recorded response to ``key``.

        Raises:
            ReplayMiss: none recorded (or all already served).
        """
        digest = key.digest()
        with self._lock:
            queue = self._answers.get(digest)
            if not queue:
                self.misses.append(key)
                raise ReplayMiss(key, self._served[digest])
            self._served[digest] += 1
            return queue.popleft()

    def call_sync(
        self, key: CallKey, live: Callable[[], bytes], failed: FailedOf = _never
    ) -> bytes:
        return self.answer(key)

    async def call(
        self, key: CallKey, live: Callable[[], Awaitable[bytes]], failed: FailedOf = _never
    ) -> bytes:
        return self.answer(key)


_active: Passthrough | Recorder | Replayer | None = None
_active_lock = threading.Lock()


def active_layer(environ: Mapping[str, str] | None = None) -> Passthrough | Recorder | Replayer:
    """The layer this process's calls go through: replay if ``$DSEC_REPLAY_FILE`` is set, else
    record if ``$DSEC_RECORD_FILE`` is, else pass-through (read once, then cached)."""
    global _active
    if environ is None and _active is not None:
        return _active
    env = os.environ if environ is None else environ
    layer: Passthrough | Recorder | Replayer
    if env.get(ENV_REPLAY):
        layer = Replayer.from_file(Path(env[ENV_REPLAY]))
    elif env.get(ENV_RECORD):
        layer = Recorder(Path(env[ENV_RECORD]))
    else:
        layer = Passthrough()
    if environ is None:
        with _active_lock:
            if _active is None:
                _active = layer
            return _active
    return layer


def reset_active_layer() -> None:
    """Forget the cached layer (tests; a process that changed its environment)."""
    global _active
    _active = None


# --- tool calls: their outcome as bytes ------------------------------------------------------

OK: Final = 0
ERROR: Final = 1


def encode_result(value: Any) -> bytes:
    """A tool's result as recorded: ``[0, value]`` in MessagePack."""
    body: bytes = msgpack.packb([OK, value], use_bin_type=True)
    return body


def encode_error(frame: list[str]) -> bytes:
    """A tool's error as recorded: ``[1, [code, error_type, message, summary]]``."""
    body: bytes = msgpack.packb([ERROR, frame], use_bin_type=True)
    return body


def is_error(body: bytes) -> bool:
    try:
        return bool(msgpack.unpackb(body, raw=False)[0] == ERROR)
    except (ValueError, TypeError, IndexError, msgpack.ExtraData):
        return False


def decode_outcome(body: bytes) -> tuple[bool, Any]:
    """``(ok, value)`` of a recorded tool outcome (value: the result, or the error frame)."""
    kind, value = msgpack.unpackb(body, raw=False, strict_map_key=False)
    return kind == OK, value


__all__ = [
    "ENV_RECORD",
    "ENV_REPLAY",
    "HTTP_KEY_HEADERS",
    "CallKey",
    "Entry",
    "Layer",
    "Passthrough",
    "Recorder",
    "ReplayMiss",
    "Replayer",
    "active_layer",
    "http_key",
    "iter_entries",
    "parse_entries",
    "read_entries",
    "tool_key",
]
