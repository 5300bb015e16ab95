"""The file a recording sandbox writes its tool calls into is the sandbox's to shape: the node
agent (root, on the host's view of the files) must read it as a plain file and nothing else."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dsec_core.layout import NodeLayout
from dsec_sdk.recording import Entry, Recorder, tool_key
from dsec_testing.plans import minimal_plan

from dsec_nodeagent.recording import Recordings
from dsec_nodeagent.sandbox.plan import kept_dir


class _Store:
    """Keeps what would be saved (the real one seals it into S3)."""

    def __init__(self) -> None:
        self.saved: list[tuple[str, list[Entry]]] = []

    async def save(self, tenant: str, entries: list[Entry]) -> Any:
        self.saved.append((tenant, entries))
        n = len(entries)
        return SimpleNamespace(
            recording_id="rec_" + "0" * 32, root_hash="0" * 64, calls=n, tool_calls=n, http_calls=0,
            failed_calls=0, bytes=0, new_objects=0,
        )  # fmt: skip


def _recording(tenant: str) -> Any:
    plan = minimal_plan("rec", "record: {tools: true}\n")
    return plan.model_copy(update={"tenant": tenant})


def _calls_dir(root: Path, sid: str) -> Path:
    """The sandbox's /dsec/recording on the host (its manager makes it, on its disk quota)."""
    kept = kept_dir(NodeLayout.of(root).sandbox(sid).root, "/dsec/recording")
    kept.mkdir(parents=True, exist_ok=True)
    return kept


async def test_a_link_in_place_of_the_calls_file_reads_nothing_through_it(
    tmp_path: Path,
) -> None:
    store = _Store()
    recordings = Recordings(NodeLayout.of(tmp_path), store)  # type: ignore[arg-type]
    victim = await recordings.prepare("sbx_victim", _recording("globex"))
    attacker = await recordings.prepare("sbx_attacker", _recording("acme"))
    assert victim is not None and attacker is not None
    secret = tool_key("crm", "customers", {"q": "globex only"})
    victims = _calls_dir(tmp_path, "sbx_victim") / "calls.jsonl"
    Recorder(victims).call_sync(secret, lambda: b"\x92\x00\x90")
    # the attacking sandbox replaces its own calls file with a link to the victim's (sandbox
    # ids are on the bus, the node's layout is the same everywhere)
    (_calls_dir(tmp_path, "sbx_attacker") / "calls.jsonl").symlink_to(victims)

    await recordings.finish("sbx_attacker")
    leaked = [tenant for tenant, entries in store.saved if secret in [e.key for e in entries]]
    assert leaked == []  # nothing of globex's went into acme's recording


async def test_a_calls_file_beyond_the_limit_is_not_read_into_the_node_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sandbox decides how big its calls file grows; the node agent reads its calls at the
    end, so one past MAX_SANDBOX_BYTES is refused by its size (the recording is not saved, a
    warning says why) before a byte of it is read."""
    import dsec_nodeagent.recording as recording

    monkeypatch.setattr(recording, "MAX_SANDBOX_BYTES", 1 << 20)  # (a small limit: same check)
    store = _Store()
    recordings = Recordings(NodeLayout.of(tmp_path), store)  # type: ignore[arg-type]
    prepared = await recordings.prepare("sbx_big", _recording("acme"))
    assert prepared is not None
    calls = _calls_dir(tmp_path, "sbx_big") / "calls.jsonl"
    for n in range(20):  # well-formed calls (a big argument each): ~1.2 MB
        Recorder(calls).call_sync(
            tool_key("crm", "put", {"n": n, "pad": "x" * 60_000}), lambda: b"\x90"
        )
    assert calls.stat().st_size > 1 << 20
    assert await recordings.finish("sbx_big") is None
    assert store.saved == []


async def test_recordings_of_sandboxes_ending_together_are_read_and_stored_one_at_a_time(
    tmp_path: Path,
) -> None:
    """Each recording may hold up to MAX_SANDBOX_BYTES of calls in the node agent's memory
    while it is read and stored; sandboxes that end together must not add theirs up (a
    neighbour's recording would then be what makes the node agent run out of memory)."""
    import asyncio

    class _Slow(_Store):
        def __init__(self) -> None:
            super().__init__()
            self.running = 0
            self.most = 0

        async def save(self, tenant: str, entries: list[Entry]) -> Any:
            self.running += 1
            self.most = max(self.most, self.running)
            await asyncio.sleep(0.01)  # (storing takes a while: the others' reads come in)
            self.running -= 1
            return await super().save(tenant, entries)

    store = _Slow()
    recordings = Recordings(NodeLayout.of(tmp_path), store)  # type: ignore[arg-type]
    sids = [f"sbx_{n}" for n in range(4)]
    for n, sid in enumerate(sids):
        assert await recordings.prepare(sid, _recording("acme")) is not None
        calls = _calls_dir(tmp_path, sid) / "calls.jsonl"
        Recorder(calls).call_sync(tool_key("crm", "get", {"n": n}), lambda: b"\x90")
    saved = await asyncio.gather(*(recordings.finish(sid) for sid in sids))
    assert all(s is not None for s in saved) and len(store.saved) == 4
    assert store.most == 1


def test_a_calls_file_is_read_line_by_line_up_to_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read line by line (never whole), and a file that grew past the limit after its size was
    checked is refused when the lines read add up past it."""
    import io

    import dsec_nodeagent.recording as recording

    monkeypatch.setattr(recording, "MAX_SANDBOX_BYTES", 100)
    assert list(recording._bounded_lines(io.BytesIO(b"a\n" * 50))) == [b"a\n"] * 50
    with pytest.raises(ValueError, match="over 100 bytes"):
        list(recording._bounded_lines(io.BytesIO(b"a\n" * 51)))
    with pytest.raises(ValueError, match="over 100 bytes"):
        list(recording._bounded_lines(io.BytesIO(b"x" * 500)))  # one long line
