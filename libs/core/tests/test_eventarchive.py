"""The archive's segment and manifest formats (pure): what a reader accepts and refuses."""

from __future__ import annotations

import dataclasses

import pytest
from dsec_core import identity
from dsec_core.eventarchive import (
    ArchiveCorrupt,
    ArchiveError,
    Manifest,
    ManifestSigner,
    Record,
    check_segment,
    make_segment,
    message_hash,
    unpack_segment,
)
from dsec_core.identity import Role
from nacl.signing import SigningKey


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
    with pytest.raises(ArchiveCorrupt, match="is not a manifest"):  # nested past the stack
        Manifest.parse(b"[" * 100_000)


def _key(root: SigningKey, role: Role = "operator") -> tuple[SigningKey, identity.Certificate]:
    key = SigningKey.generate()
    return key, identity.issue(root, bytes(key.verify_key), subject=role, role=role)


def test_signed_manifest_verifies_and_refuses_any_change() -> None:
    root = SigningKey.generate()
    seg, _ = make_segment(_records(1, 3))
    manifest = Manifest(segments=[seg], last_hash=message_hash(b"x"))
    with pytest.raises(ArchiveCorrupt, match="is not signed"):
        manifest.verify(bytes(root.verify_key))
    manifest.sign(*_key(root))
    read = Manifest.parse(manifest.to_bytes())
    assert read == manifest and read.verify(bytes(root.verify_key)).role == "operator"
    assert read.digest() == manifest.digest()

    cut = dataclasses.replace(read, segments=[make_segment(_records(1, 2))[0]])
    with pytest.raises(ArchiveCorrupt, match="signature does not match"):
        cut.verify(bytes(root.verify_key))
    with pytest.raises(ArchiveCorrupt, match="did not certify"):
        read.verify(bytes(SigningKey.generate().verify_key))
    agent = Manifest(segments=[seg], last_hash=message_hash(b"x"))
    agent.sign(*_key(root, "nodeagent"))
    with pytest.raises(ArchiveCorrupt, match=r"role nodeagent\), not by the operator"):
        agent.verify(bytes(root.verify_key))
    with pytest.raises(ArchiveError, match="signed by the operator, not role nodeagent"):
        ManifestSigner(*_key(root, "nodeagent"), bytes(root.verify_key))
    with pytest.raises(ArchiveError, match="does not hold"):
        ManifestSigner(*_key(SigningKey.generate()), bytes(root.verify_key))


def test_format_1_manifest_is_refused_as_unsigned() -> None:
    with pytest.raises(ArchiveCorrupt, match="format 1, not signed"):
        Manifest.parse(b'{"stream": "DSEC_EVENTS", "format": 1, "segments": []}')
