"""The MessagePack object count (dsec_sdk.state.msgcount): the C scan and its Python twin give
the same answers, and those answers are the number of objects decoding would make."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from dsec_sdk import AgentState
from dsec_sdk.state import LocalStore, codec, msgcount
from hypothesis import given, settings
from hypothesis import strategies as st

COUNTERS = [pytest.param(msgcount.count_py, id="python")]
if msgcount.ACCELERATED:
    _count_c = msgcount._count_c

    COUNTERS.append(pytest.param(_count_c, id="c"))


@pytest.fixture
def ring_mode() -> str:
    """The count does not use the ring: run each test once."""
    return "n/a"


def objects(value: Any) -> int:
    """What decoding ``value``'s packed form makes: one object per value, key and element."""
    if isinstance(value, dict):
        return 1 + sum(objects(k) + objects(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 1 + sum(objects(v) for v in value)
    return 1


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, width=32)
    | st.text(max_size=300)
    | st.binary(max_size=600)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=20)
        | st.dictionaries(
            st.text(max_size=8) | st.integers(min_value=-(2**63), max_value=2**64 - 1),
            inner,
            max_size=20,
        )
    ),
    max_leaves=60,
)


@pytest.mark.parametrize("count", COUNTERS)
@settings(max_examples=150, deadline=None)
@given(value=values, single_float=st.booleans())
def test_the_count_is_what_decoding_makes(count: Any, value: Any, single_float: bool) -> None:
    body = msgpack.packb(value, use_bin_type=True, use_single_float=single_float)
    assert count(body, 1 << 40) == objects(value)
    assert count(body + b"\x90\x90", 1 << 40) == objects(value)  # (the first value only)


@pytest.mark.parametrize("count", COUNTERS)
@settings(max_examples=100, deadline=None)
@given(value=values)
def test_a_cut_value_is_refused_and_a_limit_stops_the_count(count: Any, value: Any) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    for cut in {0, len(body) // 2, len(body) - 1} - {len(body)}:
        if cut < len(body):
            with pytest.raises(ValueError, match="cut short"):
                count(body[:cut], 1 << 40)
    total = objects(value)
    assert count(body, total) == total
    assert count(body, total - 1) == total  # (limit + 1: stopped past it)


def _keys_all_strings(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, (str, bytes)) and _keys_all_strings(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_keys_all_strings(v) for v in value)
    return True


@pytest.mark.parametrize("count", COUNTERS)
@settings(max_examples=80, deadline=None)
@given(value=values)
def test_strict_refuses_what_a_strict_decode_refuses(count: Any, value: Any) -> None:
    """With strict, a map key must be a str or bin (salted hashes), as msgpack's
    strict_map_key decode has it."""
    body = msgpack.packb(value, use_bin_type=True)
    if _keys_all_strings(value):
        assert count(body, 1 << 40, strict=True) == objects(value)
        msgpack.unpackb(body, strict_map_key=True)
    else:
        with pytest.raises(ValueError, match="a map key that is not a string"):
            count(body, 1 << 40, strict=True)
        with pytest.raises(ValueError):
            msgpack.unpackb(body, strict_map_key=True)


@pytest.mark.parametrize("count", COUNTERS)
def test_strict_refuses_extension_types_anywhere(count: Any) -> None:
    """A timestamp hashes as a tuple wherever it lands in a dict (a vectors id, a key), and an
    ext decodes to two or three objects: a frame from an agent carries none."""
    for ext in (msgpack.Timestamp(1, 5), msgpack.ExtType(5, b"x"), msgpack.ExtType(7, b"y" * 300)):
        body = msgpack.packb({"ids": ["a", ext]}, use_bin_type=True)
        assert count(body, 100) == 5
        with pytest.raises(ValueError, match="an extension type"):
            count(body, 100, strict=True)


@pytest.mark.parametrize("count", COUNTERS)
def test_nesting_is_refused_where_msgpack_refuses_it(count: Any) -> None:
    for depth in (1022, 1023, 1024, 1025):
        for inner in (b"\x90", b"\x80", b"\xc0", b"\x81\xa1k\xc0", b"\x91\xc0"):
            body = b"\x91" * depth + inner
            try:
                msgpack.unpackb(body)
            except msgpack.StackError:
                with pytest.raises(ValueError, match="nested deeper than 1024"):
                    count(body, 1 << 40)
            else:
                assert count(body, 1 << 40) == depth + objects(msgpack.unpackb(inner))


@pytest.mark.parametrize("count", COUNTERS)
def test_ext_types_and_lengths_of_every_width(count: Any) -> None:
    cases: list[tuple[bytes, int]] = [
        (msgpack.packb(msgpack.ExtType(5, b"x" * n)), 1) for n in (1, 2, 4, 8, 16, 3, 300, 70000)
    ]
    cases += [
        (b"\xdc" + struct.pack(">H", 3) + b"\x01\x02\x03", 4),  # array 16
        (b"\xdd" + struct.pack(">I", 2) + b"\xc0\xc0", 3),  # array 32
        (b"\xde" + struct.pack(">H", 1) + b"\xa1k\x01", 3),  # map 16
        (b"\xdf" + struct.pack(">I", 1) + b"\xa1k\x01", 3),  # map 32
        (b"\xd9\x03abc", 1),  # str 8
        (b"\xc5\x00\x02ab", 1),  # bin 16
        (b"\xd3" + b"\x00" * 8, 1),  # int 64
        (b"\xca" + b"\x00" * 4, 1),  # float 32
    ]
    for body, expected in cases:
        assert count(body, 1 << 40) == expected, body[:8]


@pytest.mark.parametrize("count", COUNTERS)
def test_what_is_not_messagepack_is_said(count: Any) -> None:
    with pytest.raises(ValueError, match="0xc1"):
        count(b"\x92\x01\xc1", 100)
    # an array announcing more elements than there are bytes: cut short, at once
    with pytest.raises(ValueError, match="cut short"):
        count(b"\xdd\xff\xff\xff\xff" + b"\x90" * 10, 1 << 40)
    with pytest.raises(ValueError, match="cut short"):
        count(b"\xc6\xff\xff\xff\xff", 1 << 40)  # a bin longer than the buffer
    with pytest.raises(TypeError):
        count("not bytes", 10)


def test_a_hostile_frame_is_stopped_at_the_limit_without_being_made() -> None:
    """64 MiB of one-byte empty arrays would be 64 million lists: counted, it stops at the
    limit (and, in C, without holding the GIL)."""
    n = 64 << 20
    body = b"\xdd" + struct.pack(">I", n) + b"\x90" * n
    limit = msgcount.MAX_FRAME_OBJECTS
    assert msgcount.count(body, limit) == limit + 1
    if msgcount.ACCELERATED:  # (the Python twin takes ~30 s to walk them all)
        assert msgcount.count(memoryview(body), 1 << 40) == n + 1


# ------------------------------------------------------------- frames within the keeper's bound
def test_a_value_too_many_objects_for_a_frame_is_refused_where_it_is_stored(
    tmp_path: Path,
) -> None:
    """A kv value or log item of more objects than a checkpoint frame may carry for one item
    is refused as it is stored, naming it (not at a checkpoint, where nothing could be done)."""
    state = AgentState.open(tmp_path)
    too_many = [0] * (codec.MAX_ITEM_OBJECTS + 1)
    with pytest.raises(ValueError, match=r"kv 'memo'\['big'\]: the value holds more than"):
        state.kv("memo")["big"] = too_many
    with pytest.raises(ValueError, match=r"kv 'memo'\['ints'\]: a map key that is not a string"):
        state.kv("memo")["ints"] = {"counts": {1: 5}}
    with pytest.raises(ValueError, match="log 'history': an extension type"):
        state.log("history").append([msgpack.Timestamp(1, 0)])
    with pytest.raises(ValueError, match="log 'history': the value holds more than"):
        state.log("history").append({"rows": too_many})
    state.kv("memo")["fine"] = too_many[:-2]  # (the list itself is one object)
    assert "big" not in state.kv("memo") and len(state.log("history")) == 0
    state.close()


def test_a_checkpoint_of_many_items_is_cut_into_frames_the_keeper_takes(tmp_path: Path) -> None:
    """300,000 kv entries and 600,000 vector ids in one checkpoint (each record more objects
    than a frame may hold): each frame holds at most the keeper's bound, and the state
    restores whole. (Logs are cut the same way: test_a_record_cut_gives_the_same_value.)"""
    sent: list[int] = []
    store = LocalStore(tmp_path)
    real = store.checkpoint

    def counted(seq: int, frame: bytes) -> Any:
        sent.append(msgcount.count(frame[4:], 1 << 40))
        return real(seq, frame)

    store.checkpoint = counted  # type: ignore[method-assign]
    state = AgentState(store, agent="a", group="g")
    entries = {f"k{i}": i for i in range(300_000)}
    state.kv("memo").update(entries)
    n = 600_000
    state.vectors("v", 1).upsert([f"v{i}" for i in range(n)], np.arange(n, dtype="f4")[:, None])
    info = state.checkpoint()
    assert info.frames == len(sent) >= 2
    assert max(sent) <= msgcount.MAX_FRAME_OBJECTS
    state.close()
    again = AgentState.open(tmp_path)
    assert dict(again.kv("memo")) == entries
    restored = again.vectors("v", 1)
    assert len(restored) == n and restored.get(f"v{n - 1}")[0] == n - 1
    again.close()


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["kv set", "kv full", "kv del", "log append", "log full", "vectors"]),
    sizes=st.lists(st.integers(min_value=0, max_value=10), min_size=1, max_size=60),
    room=st.integers(min_value=40, max_value=200),
)
def test_a_record_cut_gives_the_same_value(kind: str, sizes: list[int], room: int) -> None:
    """split_packed's pieces, applied in order, give what the whole record gives, each within
    its bound."""
    head = {"c": "x", "t": "hot"}
    base: list[dict[str, Any]] = []
    if kind.startswith("kv"):
        record = {
            **head,
            "k": "kv",
            "o": kind[3:],
            "items": {f"k{i}": [0] * s for i, s in enumerate(sizes)},
        }
        if kind == "kv del":
            record = {**head, "k": "kv", "o": "del", "keys": [f"k{i}" for i in range(len(sizes))]}
            base = [{**head, "k": "kv", "o": "full", "items": {f"k{i}": i for i in range(80)}}]
    elif kind.startswith("log"):
        items = [[f"{i:08d}", "h", [0] * s] for i, s in enumerate(sizes)]
        record = {**head, "k": "log", "o": kind[4:], "items": items}
    else:
        ids = [f"v{i}" for i in range(len(sizes))]
        vec = b"".join(struct.pack("<f", s) for s in sizes)
        record = {
            **head,
            "k": "vectors",
            "o": "full",
            "dim": 1,
            "dtype": "<f4",
            "ids": ids,
            "vec": vec,
        }
    body = msgpack.packb(record, use_bin_type=True)
    pieces = codec.split_packed(body, room)
    assert all(n <= room and msgcount.count(p, 1 << 40) == n for p, n in pieces)
    if msgcount.count(body, 1 << 40) <= room:
        assert pieces == [(body, msgcount.count(body, 1 << 40))]
    whole = codec.fold([*base, record])
    cut = codec.fold([*base, *(msgpack.unpackb(p, strict_map_key=False) for p, _ in pieces)])
    assert cut == whole


def test_a_record_that_cannot_be_cut_is_said() -> None:
    record = {"c": "x", "k": "kv", "t": "hot", "o": "set", "items": {"big": list(range(100))}}
    with pytest.raises(codec.CodecError, match="one item of more than"):
        codec.split_packed(msgpack.packb(record), 50)
    blob = {
        "c": "b",
        "k": "array",
        "t": "warm",
        "o": "full",
        "dtype": "<f4",
        "shape": list(range(60)),
        "data": b"",
    }
    with pytest.raises(codec.CodecError, match="cannot be cut"):
        codec.split_packed(msgpack.packb(blob), 50)
