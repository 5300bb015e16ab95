"""Pure parts of the client: how a spec argument is read, error classes and exit statuses,
the sync twin's private loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from dsec_client import DSecError, InvalidInput, Refused, Stalled, Timeout
from dsec_client.code import spec_text
from dsec_client.remote import bytes_feeder
from dsec_client.sync import _Loop
from dsec_core import remote

pytestmark = pytest.mark.unit


def test_a_spec_is_a_path_text_or_dict(tmp_path: Path) -> None:
    folder = tmp_path / "agent"
    folder.mkdir()
    spec = folder / "dsec.yaml"
    spec.write_text("version: '1.2'\n")
    assert spec_text(spec) == ("version: '1.2'\n", "agent/dsec.yaml")
    assert spec_text(str(spec)) == ("version: '1.2'\n", "agent/dsec.yaml")
    assert spec_text("version: '1.2'\nname: x\n") == ("version: '1.2'\nname: x\n", "spec.yaml")
    assert spec_text("{version: '1.2'}") == ("{version: '1.2'}", "spec.yaml")
    text, name = spec_text({"version": "1.2", "name": "x"})
    assert text == "version: '1.2'\nname: x\n" and name == "spec.yaml"
    with pytest.raises(InvalidInput, match=r"cannot read spec .*missing\.yaml"):
        spec_text(str(tmp_path / "missing.yaml"))


def test_errors_carry_the_cli_exit_status() -> None:
    assert issubclass(Stalled, Timeout) and Stalled("x").EXIT == 4
    assert Refused("node n refused: not-running: gone", "not-running").EXIT == 2
    refused = Refused("node n refused: cross-tenant: no", "cross-tenant")
    assert refused.EXIT == 1 and refused.reason == "cross-tenant"
    assert isinstance(refused, DSecError)


def test_exec_input_is_fed_in_chunks_then_its_end() -> None:
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    data = b"x" * (remote.CHUNK * 2 + 1)
    bytes_feeder(data)(queue)
    chunks = []
    while (chunk := queue.get_nowait()) is not None:
        chunks.append(chunk)
    assert b"".join(chunks) == data and len(chunks) == 3


def test_the_private_loop_runs_coroutines_and_iterators_and_stops() -> None:
    loop = _Loop()

    async def numbers():  # type: ignore[no-untyped-def]
        for i in range(3):
            await asyncio.sleep(0)
            yield i

    async def fail() -> None:
        raise InvalidInput("bad")

    assert loop.run(asyncio.sleep(0, result=7)) == 7
    assert list(loop.iterate(numbers())) == [0, 1, 2]
    with pytest.raises(InvalidInput):
        loop.run(fail())
    loop.close()
    assert loop.loop.is_closed()
