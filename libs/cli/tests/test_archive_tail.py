"""`audit verify --archive`: where the live stream still holds the archive's last sequence, it
must be the message the signed manifest pins (BLAKE3)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dsec_cli.commands.audit import _tail_problem
from dsec_core.eventarchive import Manifest, Record, make_segment, message_hash
from nats.js.errors import NotFoundError


class _Stream:
    def __init__(self, first: int, last: int, data: dict[int, bytes]) -> None:
        self.state = SimpleNamespace(messages=last - first + 1, first_seq=first, last_seq=last)
        self.data = data

    async def stream_info(self, _name: str) -> Any:
        return SimpleNamespace(state=self.state)

    async def get_msg(self, _name: str, seq: int) -> Any:
        if seq not in self.data:
            raise NotFoundError
        return SimpleNamespace(data=self.data[seq])


def _manifest(last: bytes) -> Manifest:
    segment, _ = make_segment([Record(1, "dsec.x", 0, b"a"), Record(2, "dsec.x", 0, last)])
    return Manifest(segments=[segment], last_hash=message_hash(last))


async def test_the_stream_s_message_at_the_archive_s_last_seq_must_be_the_pinned_one() -> None:
    manifest = _manifest(b"b")
    assert await _tail_problem(_Stream(1, 3, {2: b"b"}), manifest) is None
    problem = await _tail_problem(_Stream(1, 3, {2: b"other"}), manifest)
    assert problem is not None and "last message (seq 2) is not the live stream's" in problem


async def test_a_stream_that_no_longer_holds_it_is_left_to_the_sequence_check() -> None:
    manifest = _manifest(b"b")
    assert await _tail_problem(_Stream(3, 5, {}), manifest) is None  # discarded by limits
    assert await _tail_problem(_Stream(1, 3, {}), manifest) is None  # per-subject discard
