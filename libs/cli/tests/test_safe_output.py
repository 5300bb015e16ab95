"""What the CLI prints from events, file names and logs shows control characters, never runs
them: ANSI escapes, newlines, carriage returns, bidi overrides and rich markup come out escaped."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import nats
import pytest
from dsec_cli.common import safe_lines, safe_text
from dsec_cli.main import app
from dsec_core import events
from dsec_core.bus import EventPublisher, ensure_stream
from dsec_core.signing import Signer, load_or_create_key
from typer.testing import CliRunner

if TYPE_CHECKING:
    from dsec_testing.stack import S3Info, VaultInfo

runner = CliRunner()
HOSTILE = "evil\x1b[2J\x1b[31mred\rover\nnext\u202eexe.txt[bold]x[/bold]\x07"


@pytest.mark.unit
def test_safe_text_escapes_controls_bidi_and_markup() -> None:
    text = safe_text(HOSTILE)
    assert "\x1b" not in text and "\r" not in text and "\n" not in text and "\u202e" not in text
    assert "\x07" not in text
    assert "\\x1b[2J\\x1b[31mred\\rover\\nnext\\u202eexe.txt" in text
    assert "\\[bold]x\\[/bold]" in text  # rich prints it literally
    assert safe_text("plain café ☕") == "plain café ☕"  # printable text is untouched


@pytest.mark.unit
def test_safe_lines_keeps_line_breaks_and_escapes_the_rest() -> None:
    assert safe_lines("a\x1b[31m\nb\r\n", markup=False) == "a\\x1b[31m\nb\\r\n"


async def _publish_hostile(nats_url: str, home: Path, sandbox_id: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_stream(js)
        publisher = EventPublisher(js, Signer("cli", load_or_create_key(home / "k.key")))
        await publisher.register_key()
        await publisher.publish(
            events.SpecSubmitted(spec_yaml="x", filename=HOSTILE, submitted_by=HOSTILE),
            aggregate_id=sandbox_id,
        )
        await publisher.publish(
            events.PolicyViolation(
                layer="kernel", rule_id=HOSTILE, action="deny", operation="open", target=HOSTILE
            ),
            aggregate_id=sandbox_id,
        )
    finally:
        await nc.drain()


@pytest.mark.integration
def test_audit_replay_prints_hostile_event_text_escaped(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = f"sbx_{uuid.uuid4().hex[:12]}"
    asyncio.run(_publish_hostile(nats_url, tmp_path, sid))
    monkeypatch.setenv("DSEC_NATS_URL", nats_url)
    monkeypatch.setenv("DSEC_HOME", str(tmp_path / "home"))
    result = runner.invoke(app, ["audit", "replay", "--sandbox", sid])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\r" not in result.output
    assert "\u202e" not in result.output
    lines = [line for line in result.output.splitlines() if sid in line]
    assert len(lines) == 2, result.output  # one line per event: the newline did not split it
    assert "evil\\x1b[2J\\x1b[31mred\\rover\\nnext\\u202eexe.txt[bold]x[/bold]\\x07" in lines[1]
    tail = runner.invoke(app, ["events", "tail", "--all", "--sandbox", sid, "-n", "2"])
    assert tail.exit_code == 0, tail.output
    assert "\x1b" not in tail.output and "\\x1b[31mred" in tail.output


@pytest.mark.integration
def test_snapshot_inspect_prints_hostile_file_names_escaped(
    s3: S3Info, vault: VaultInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {
        "DSEC_HOME": str(tmp_path / "home"),
        "DSEC_S3_ENDPOINT": s3.endpoint,
        "DSEC_S3_ACCESS_KEY": s3.access_key,
        "DSEC_S3_SECRET_KEY": s3.secret_key,
        "DSEC_S3_BUCKET": s3.bucket,
        "DSEC_VAULT_ADDR": vault.addr,
        "DSEC_VAULT_TOKEN": vault.token,
    }.items():
        monkeypatch.setenv(key, value)
    code = tmp_path / "code"
    code.mkdir()
    (code / HOSTILE.replace("/", "_")).write_text("x" * 4096)
    name = f"hostile-{uuid.uuid4().hex[:8]}"
    created = runner.invoke(app, ["snapshot", "create", "--dir", str(code), "--name", name])
    assert created.exit_code == 0, created.output
    shown = runner.invoke(app, ["snapshot", "inspect", name])
    assert shown.exit_code == 0, shown.output
    assert "\x1b" not in shown.output and "\r" not in shown.output
    assert "\u202e" not in shown.output
    assert "evil\\x1b[2J\\x1b[31mred\\rover\\nnext\\u202eexe.txt[bold]x" in shown.output
    as_json = runner.invoke(app, ["snapshot", "inspect", name, "--json"])
    assert as_json.exit_code == 0, as_json.output
    largest = json.loads(as_json.output)["largest"]
    assert [(f["path"], f["size"], f["mode"]) for f in largest] == [
        (HOSTILE.replace("/", "_"), 4096, 0o644)
    ]


LOG = "line one\n\x1b]0;owned\x07\x1b[2Jcleared\rover \u202eevil \u00e9\n".encode()


@pytest.mark.unit
def test_sandbox_logs_escapes_on_a_terminal_and_is_raw_when_piped() -> None:
    """What `dsec sandbox logs|exec` writes of the bytes the node agent streams: escaped on a
    terminal (also a character split between two frames), unchanged when piped."""
    import io

    from dsec_cli.remote import Sink

    frames = [LOG[:5], LOG[5:-2], LOG[-2:]]  # the last split cuts the two bytes of "é"
    piped = io.BytesIO()
    sink = Sink(piped, terminal=False)
    for frame in frames:
        sink.write(frame)
    assert piped.getvalue() == LOG  # redirected: the log as written

    shown = io.BytesIO()
    sink = Sink(shown, terminal=True)
    for frame in frames:
        sink.write(frame)
    sink.write(b"", final=True)
    text = shown.getvalue().decode()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b]0;owned\\x07\\x1b[2Jcleared\\rover \\u202eevil \u00e9" in text
    assert text.splitlines()[0] == "line one"  # line breaks are kept
