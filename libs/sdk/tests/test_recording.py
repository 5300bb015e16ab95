"""Record and replay (dsec_sdk.recording): call keys, the recording file, replay without a
live call, and DSecClient's tool calls through the layer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from dsec_sdk import DSecClient, RemoteError
from dsec_sdk import recording as rec
from dsec_sdk.recording import CallKey, Recorder, Replayer, ReplayMiss, http_key, tool_key


@pytest.fixture(autouse=True)
def ring_mode() -> str:  # no ring is used here: run once
    return "n/a"


@pytest.fixture(autouse=True)
def _fresh_layer() -> object:
    rec.reset_active_layer()
    yield None
    rec.reset_active_layer()


def test_tool_key_ignores_argument_order_but_not_values() -> None:
    a = tool_key("researcher", "lookup", {"query": "memfd", "limit": 3, "opts": {"b": 1, "a": 2}})
    b = tool_key("researcher", "lookup", {"opts": {"a": 2, "b": 1}, "limit": 3, "query": "memfd"})
    assert a.digest() == b.digest()
    assert len(a.digest()) == 64
    assert tool_key("researcher", "lookup", {"query": "memfd", "limit": 4}).digest() != (
        tool_key("researcher", "lookup", {"query": "memfd", "limit": 3}).digest()
    )
    assert tool_key("other", "lookup", {"query": "memfd"}).digest() != (
        tool_key("researcher", "lookup", {"query": "memfd"}).digest()
    )


def test_http_key_keeps_only_content_headers() -> None:
    base = http_key(
        "post",
        "api.example.com",
        443,
        "/v1/chat?x=1",
        [("Content-Type", "application/json"), ("Authorization", "Bearer one")],
        b'{"prompt": "hi"}',
    )
    other_key = http_key(
        "POST",
        "api.example.com",
        443,
        "/v1/chat?x=1",
        [("content-type", "application/json"), ("Authorization", "Bearer two"), ("X-Trace", "9")],
        b'{"prompt": "hi"}',
    )
    assert base.digest() == other_key.digest()  # credentials and tracing ids are not in the key
    assert base.headers == (("content-type", "application/json"),)
    assert base.name == "POST /v1/chat?x=1" and base.target == "api.example.com:443"
    changed = http_key("POST", "api.example.com", 443, "/v1/chat?x=1", [], b'{"prompt": "ho"}')
    assert (
        changed.digest()
        != http_key(
            "POST", "api.example.com", 443, "/v1/chat?x=1", [], b'{"prompt": "hi"}'
        ).digest()
    )


def test_the_digest_is_pinned() -> None:
    # a recording made today must replay tomorrow: the canonical encoding may not drift
    key = CallKey("tool", "researcher", "lookup", rec.pack_canonical({"query": "memfd"}))
    assert key.digest() == "a76da44c8bd99b4bb66dae12f6e3011bcabc4c5868d3219c3c55afa5569f8bb4"


def test_record_then_replay_byte_for_byte_and_in_order(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    recorder = Recorder(path)
    key = tool_key("a", "t", {"q": 1})
    answers = iter([b"first", b"second"])
    assert recorder.call_sync(key, lambda: next(answers)) == b"first"
    assert recorder.call_sync(key, lambda: next(answers)) == b"second"

    async def alive() -> bytes:
        return b"\x00\xffbinary"

    other = tool_key("a", "t", {"q": 2})
    assert asyncio.run(recorder.call(other, alive)) == b"\x00\xffbinary"

    live_calls = 0

    def live() -> bytes:
        nonlocal live_calls
        live_calls += 1
        return b"LIVE"

    replayer = Replayer.from_file(path)
    assert replayer.call_sync(key, live) == b"first"
    assert replayer.call_sync(key, live) == b"second"
    assert replayer.call_sync(other, live) == b"\x00\xffbinary"
    with pytest.raises(ReplayMiss, match="already served"):
        replayer.call_sync(key, live)  # a third identical call was never recorded
    with pytest.raises(ReplayMiss, match=r"no recorded answer for tool call a\.t"):
        replayer.call_sync(tool_key("a", "t", {"q": 3}), live)
    assert live_calls == 0
    assert len(replayer.misses) == 2


def test_a_torn_last_line_is_ignored_but_a_bad_middle_line_is_located(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    Recorder(path).call_sync(tool_key("a", "t", {}), lambda: b"ok")
    good = path.read_text()
    path.write_text(good + '{"digest": "ab')
    assert len(rec.read_entries(path)) == 1
    path.write_text("not json\n" + good)
    with pytest.raises(ValueError, match=r"calls\.jsonl:1: not a recorded call"):
        rec.read_entries(path)


def test_a_tampered_entry_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    Recorder(path).call_sync(tool_key("a", "t", {"q": 1}), lambda: b"ok")
    path.write_text(path.read_text().replace('"name":"t"', '"name":"u"') + "\n")
    with pytest.raises(ValueError, match="digest does not match"):
        rec.read_entries(path)


def test_client_replays_results_and_errors_without_any_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "calls.jsonl"
    recorder = Recorder(path)
    recorder.call_sync(
        tool_key("researcher", "lookup", {"query": "memfd"}),
        lambda: rec.encode_result({"summary": "anonymous file"}),
    )
    recorder.call_sync(
        tool_key("researcher", "lookup", {"query": "boom"}),
        lambda: rec.encode_error(["remote", "KeyError", "'boom'", ""]),
    )
    monkeypatch.setenv(rec.ENV_REPLAY, str(path))
    # no broker behind this socket: any live call would be BrokerUnavailable
    client = DSecClient("planner", "team", socket_path=tmp_path / "absent.sock")
    assert client.call_tool("researcher", "lookup", query="memfd") == {"summary": "anonymous file"}
    with pytest.raises(RemoteError, match="KeyError"):
        client.call_tool("researcher", "lookup", query="boom")
    with pytest.raises(ReplayMiss):
        client.call_tool("researcher", "lookup", query="other")

    async def again() -> None:
        rec.reset_active_layer()
        fresh = DSecClient("planner", "team", socket_path=tmp_path / "absent.sock")
        assert await fresh.acall_tool("researcher", "lookup", {"query": "memfd"}) == {
            "summary": "anonymous file"
        }

    asyncio.run(again())


def test_recording_mode_records_what_the_live_call_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv(rec.ENV_RECORD, str(path))
    client = DSecClient("planner", "team", socket_path=tmp_path / "absent.sock")
    calls: list[tuple[str, str, dict[str, object]]] = []

    def fake_live(
        agent: str, tool: str, merged: dict[str, object], timeout: object, trace: object = None
    ) -> object:
        calls.append((agent, tool, merged))
        if merged.get("query") == "bad":
            raise RemoteError(agent, tool, "remote", "ValueError", "bad query", "")
        return [1, 2, 3]

    monkeypatch.setattr(client, "_call_live", fake_live)
    assert client.call_tool("researcher", "lookup", query="memfd") == [1, 2, 3]
    with pytest.raises(RemoteError, match="bad query"):
        client.call_tool("researcher", "lookup", query="bad")
    entries = rec.read_entries(path)
    assert [e.failed for e in entries] == [False, True]
    assert entries[0].key == tool_key("researcher", "lookup", {"query": "memfd"})
    assert rec.decode_outcome(entries[0].response) == (True, [1, 2, 3])
    assert len(calls) == 2
