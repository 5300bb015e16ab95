"""Record and replay on the node (docs/experiments.md).

For a sandbox whose plan has ``record:``, the node agent gives it a writable directory at
:data:`RECORD_MOUNT` where the SDK appends its tool calls (``$DSEC_RECORD_FILE``): one of its
``write_allowed`` paths, so on its disk quota's filesystem like its other outputs (a directory
of the host's would let it fill the node's disk), read from its outputs when it ends. It records
the HTTP requests to the recorded hosts in its TLS proxy (into a file of its own, outside the
sandbox). When the sandbox ends, both become one recording in the object store
(:mod:`.store`) and ``recording.saved`` is published before ``sandbox.exited``.

For a sandbox whose plan has ``replay: RECORDING_ID``, the recording is loaded (the tenant's
own only, checked against its id), its tool calls are written read-only at
:data:`REPLAY_MOUNT` (``$DSEC_REPLAY_FILE``) and its HTTP calls answer the proxy; nothing
recorded is ever asked live. A recording that cannot be loaded refuses the start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final

from dsec_core import events
from dsec_core.layout import NodeLayout
from dsec_core.spec import EnforcementPlan
from dsec_sdk.recording import (
    ENV_RECORD,
    ENV_REPLAY,
    Entry,
    Recorder,
    Replayer,
    iter_entries,
    read_entries,
)

from dsec_nodeagent.recording.store import (
    RecordingCorrupt,
    RecordingNotFound,
    RecordingStore,
)
from dsec_nodeagent.sandbox.models import Mount
from dsec_nodeagent.sandbox.plan import kept_dir

log = logging.getLogger(__name__)

RECORD_MOUNT: Final = "/dsec/recording"
REPLAY_MOUNT: Final = "/dsec/replay"
CALLS_FILE: Final = "calls.jsonl"


class ReplayUnavailable(Exception):
    """The recording a sandbox replays cannot be loaded (the reason is the message)."""


@dataclass
class Prepared:
    """What a recording or replaying sandbox gets: environment, mounts, Landlock paths."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    write: list[str] = field(default_factory=list)
    http: tuple[Recorder | Replayer, frozenset[str]] | None = None
    recording_id: str | None = None
    root_hash: str | None = None


MAX_SANDBOX_BYTES = 256 << 20
"""The most a sandbox's file of recorded tool calls may hold when it ends (it is read whole)."""


def _sandbox_tool_calls(path: Path) -> list[Entry]:
    """The tool calls recorded in a file the sandbox wrote in its own directory (none when
    there is no file), read line by line: the node agent never holds the file's text whole
    (up to :data:`MAX_SANDBOX_BYTES`), only the calls.

    The sandbox chose what is at ``path``: a link there would have the node agent (root, on
    the host's view) read another sandbox's recording, or any host file, into this one's; a
    FIFO would block it. Only a plain file is read, never through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:  # ELOOP: a link
        raise ValueError(f"{CALLS_FILE} is not a plain file ({exc.strerror})") from None
    with open(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{CALLS_FILE} is not a plain file")
        if info.st_size > MAX_SANDBOX_BYTES:
            raise ValueError(
                f"{CALLS_FILE} is {info.st_size} bytes: a sandbox's recorded calls may take "
                f"at most {MAX_SANDBOX_BYTES}"
            )
        return [e for e in iter_entries(_bounded_lines(file), CALLS_FILE) if e.key.kind == "tool"]


def _bounded_lines(file: BinaryIO) -> Iterator[bytes]:
    """``file``'s lines, up to :data:`MAX_SANDBOX_BYTES` in all (it may grow while read)."""
    left = MAX_SANDBOX_BYTES
    while True:
        line = file.readline(left + 1)
        if not line:
            return
        left -= len(line)
        if left < 0:
            raise ValueError(f"{CALLS_FILE} is over {MAX_SANDBOX_BYTES} bytes")
        yield line


class Recordings:
    """The node agent's record/replay work, per sandbox."""

    def __init__(self, layout: NodeLayout, store: RecordingStore | None) -> None:
        self.layout = layout
        self.store = store
        self._record: dict[str, tuple[str, Path]] = {}  # sandbox -> (tenant, its dir)
        self._prepared: set[str] = set()  # sandboxes with a recording or replay directory
        # One recording read and stored at a time: each may hold up to MAX_SANDBOX_BYTES of
        # calls in memory, and sandboxes ending together would add theirs up in the node
        # agent (a neighbour's recording must not be what makes it run out of memory).
        self._saving = asyncio.Semaphore(1)

    def _dir(self, sid: str) -> Path:
        return self.layout.sandbox(sid).root / "recording"

    async def prepare(self, sid: str, plan: EnforcementPlan) -> Prepared | None:
        """Set up recording or replay for ``sid`` (None: neither).

        Raises:
            ReplayUnavailable: the replayed recording is missing, another tenant's, or altered.
        """
        if plan.record is None and plan.replay is None:
            return None
        if self.store is None:
            raise ReplayUnavailable("this node agent has no object store for recordings")
        directory = self._dir(sid)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, mode=0o700)
        self._prepared.add(sid)
        prepared = Prepared()
        if plan.replay is not None:
            try:
                root, entries = await self.store.load(plan.tenant, plan.replay)
            except (RecordingNotFound, RecordingCorrupt) as exc:
                raise ReplayUnavailable(str(exc)) from None
            shown = directory / "replay"
            shown.mkdir(mode=0o755)
            calls = shown / CALLS_FILE
            calls.write_text(
                "".join(
                    json.dumps(e.to_json(), separators=(",", ":")) + "\n"
                    for e in entries
                    if e.key.kind == "tool"
                )
            )
            calls.chmod(0o644)
            prepared.env[ENV_REPLAY] = f"{REPLAY_MOUNT}/{CALLS_FILE}"
            prepared.mounts.append(Mount(source=shown, target=REPLAY_MOUNT, read_only=True))
            prepared.read.append(REPLAY_MOUNT)
            hosts = frozenset(
                e.key.target.rsplit(":", 1)[0] for e in entries if e.key.kind == "http"
            )
            hosts |= frozenset(r.domain for r in plan.egress if r.tls_proxy and r.domain)
            prepared.http = (Replayer(e for e in entries if e.key.kind == "http"), hosts)
            prepared.recording_id, prepared.root_hash = plan.replay, root
            return prepared
        assert plan.record is not None
        self._record[sid] = (plan.tenant, directory)
        if plan.record.tools:
            # A write_allowed path: the sandbox's manager makes it, owned by the sandbox's user,
            # on the sandbox's disk quota (kept_dir), never a directory of the host's.
            prepared.env[ENV_RECORD] = f"{RECORD_MOUNT}/{CALLS_FILE}"
            prepared.read.append(RECORD_MOUNT)
            prepared.write.append(RECORD_MOUNT)
        if plan.record.http:
            prepared.http = (Recorder(directory / "http.jsonl"), frozenset(plan.record.http))
        return prepared

    def readopt(self, sid: str, plan: EnforcementPlan) -> bool:
        """A recording sandbox that outlived its node agent: what it recorded so far (its
        tool calls go on being appended by the SDK; the HTTP calls its proxy recorded before
        the restart) is saved at its exit, as if nothing happened. Its proxy died with the
        previous node agent (its HTTPS then fails closed), so no HTTP call is recorded after.
        Returns whether ``sid`` is recording."""
        directory = self._dir(sid)
        if plan.record is None or not directory.is_dir():
            return False
        self._record[sid] = (plan.tenant, directory)
        self._prepared.add(sid)
        return True

    async def finish(self, sid: str) -> events.RecordingSaved | None:
        """Store what ``sid`` recorded (None: it recorded nothing, or is not recording)."""
        found = self._record.pop(sid, None)
        if found is None or self.store is None:
            self.forget(sid)
            return None
        tenant, directory = found
        try:
            entries: list[Entry] = []
            # the sandbox wrote this file: only tool calls are taken from it
            # (in a worker thread: up to MAX_SANDBOX_BYTES to read and parse, off the loop)
            calls = kept_dir(self.layout.sandbox(sid).root, RECORD_MOUNT) / CALLS_FILE
            if not calls.exists() and (directory / "sandbox").is_dir():
                calls = directory / "sandbox" / CALLS_FILE  # started before its own quota dir
            async with self._saving:
                entries += await asyncio.to_thread(_recorded, calls, directory / "http.jsonl")
                saved = await self.store.save(tenant, entries)
        except ValueError as exc:
            log.warning("%s: its recording is not saved: %s", sid, exc)
            return None
        finally:
            self.forget(sid)
        return events.RecordingSaved(
            recording_id=saved.recording_id,
            root_hash=saved.root_hash,
            calls=saved.calls,
            tool_calls=saved.tool_calls,
            http_calls=saved.http_calls,
            failed_calls=saved.failed_calls,
            bytes=saved.bytes,
            new_objects=saved.new_objects,
        )

    def forget(self, sid: str) -> None:
        """Drop what ``sid`` recorded and its directory (nothing for other sandboxes)."""
        self._record.pop(sid, None)
        if sid in self._prepared:
            self._prepared.discard(sid)
            shutil.rmtree(self._dir(sid), ignore_errors=True)


def _recorded(sandbox_calls: Path, http_calls: Path) -> list[Entry]:
    """The tool calls the sandbox wrote and the HTTP calls its proxy recorded."""
    entries = _sandbox_tool_calls(sandbox_calls)
    if http_calls.is_file():
        entries += [e for e in read_entries(http_calls) if e.key.kind == "http"]
    return entries
