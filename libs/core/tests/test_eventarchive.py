"""The archive's segment and manifest formats (pure): what a reader accepts and refuses."""

from __future__ import annotations

import pytest
from dsec_core.eventarchive import (
    ArchiveCorrupt,
    Manifest,
    Record,
    check_segment,
    make_segment,
    unpack_segment,
)


def _records(first: int, n: int) -> list[Record]:
    return [
        Record(s, f"dsec.sandbox.s{s}.ready", 1_700_000_000_000_000 + s, bytes([s % 256]) * s)
        for s in range(first, first + n)
    ]


def test_segment_round_trip_is_byte_exact() -> None:
    records = _records(7, 5)
    segment, blob = make_segment(records)
    assert (segment.first_seq, segment.last_seq, segment.count) == (7, 11, 5)
    assert segment.key.endswith("00000000000000000007-00000000000000000011.seg.zst")
    assert check_segment(segment, blob) == records
    assert unpack_segment(blob) == records


def test_altered_or_wrong_segment_is_refused() -> None:
    segment, _ = make_segment(_records(1, 3))
    other_segment, other = make_segment(_records(2, 3))
    with pytest.raises(ArchiveCorrupt, match=r"\(seq 1-3\) was altered: BLAKE3"):
        check_segment(segment, other)
    # A manifest entry that names the right hash but other sequences.
    shifted = other_segment.__class__(**{**other_segment.__dict__, "first_seq": 1, "last_seq": 3})
    with pytest.raises(ArchiveCorrupt, match="does not hold those sequences"):
        check_segment(shifted, other)
    with pytest.raises(ValueError, match="not a segment"):
        unpack_segment(b"garbage")


def test_manifest_must_be_contiguous() -> None:
    a, _ = make_segment(_records(1, 3))
    b, _ = make_segment(_records(4, 2))
    c, _ = make_segment(_records(7, 2))
    good = Manifest(segments=[a, b])
    assert Manifest.parse(good.to_bytes()) == good
    assert (good.first_seq, good.last_seq, good.events) == (1, 5, 5)
    with pytest.raises(ArchiveCorrupt, match="where sequence 6 comes next"):
        Manifest.parse(Manifest(segments=[a, b, c]).to_bytes())
    with pytest.raises(ArchiveCorrupt, match="is not a manifest"):
        Manifest.parse(b"{}")
