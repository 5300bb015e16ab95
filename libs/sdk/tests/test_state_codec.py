"""Every container's deltas, applied by ``codec`` (as the keeper and a restore do), give the
container's value; full records give it too; applying a record twice changes nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np
import pytest
from dsec_sdk.state import codec
from dsec_sdk.state.containers import ArrayState, Blob, KVMap, MessageLog, VectorIndex
from hypothesis import given, settings
from hypothesis import strategies as st

Capture = Callable[[Any], list[dict[str, Any]]]


@pytest.fixture(autouse=True)
def ring_mode() -> str:
    """The state plane does not use the ring: run each test once."""
    return "n/a"


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.floats(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=8,
)


def replay(records: list[dict[str, Any]], name: str) -> Any:
    return codec.fold(records)[name].value


def twice(records: list[dict[str, Any]], name: str) -> Any:
    return codec.fold(records + records)[name].value


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(values, max_size=5), min_size=1, max_size=5))
def test_log_appends_replay_to_the_same_items(
    batches: list[list[Any]], capture_records: Capture
) -> None:
    log = MessageLog(threading.RLock(), "history", "hot")
    records: list[dict[str, Any]] = []
    for batch in batches:
        log.extend(batch)
        records += capture_records(log)
    assert capture_records(log) == []
    if not records:
        return
    expected = log.value()
    assert replay(records, "history") == expected
    assert twice(records, "history") == expected  # a resent checkpoint appends nothing twice
    assert replay([codec.full_record(log)], "history") == expected
    for item_id, digest, value in expected:
        assert digest == blake3.blake3(codec.pack_canonical(value)).hexdigest()
        assert isinstance(item_id, str)
    ids = [e.id for e in log.entries()]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_log_hash_is_canonical() -> None:
    assert codec.content_hash({"a": 1, "b": 2}) == codec.content_hash({"b": 2, "a": 1})
    assert codec.content_hash({"a": 1}) != codec.content_hash({"a": 2})


ops = st.lists(
    st.tuples(st.sampled_from(["set", "del", "capture"]), st.sampled_from("abcdef"), values),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops)
def test_kv_sets_and_deletes_replay(
    ops: list[tuple[str, str, Any]], capture_records: Capture
) -> None:
    kv = KVMap(threading.RLock(), "facts", "hot")
    records: list[dict[str, Any]] = []
    for op, key, value in ops:
        if op == "set":
            kv[key] = value
        elif op == "del" and key in kv:
            del kv[key]
        else:
            records += capture_records(kv)
    records += capture_records(kv)
    result = replay(records, "facts") if records else {}
    assert result == dict(kv)
    if records:
        assert twice(records, "facts") == dict(kv)
    assert replay([codec.full_record(kv)], "facts") == dict(kv)


def test_kv_rejects_what_it_cannot_store() -> None:
    kv = KVMap(threading.RLock(), "facts", "hot")
    with pytest.raises(TypeError, match="'facts'"):
        kv["x"] = object()
    with pytest.raises(TypeError, match="keys are str"):
        kv[1] = 2  # type: ignore[index]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 8))
def test_array_sparse_capture_rebuilds_the_array(
    seed: int, steps: int, capture_records: Capture
) -> None:
    rng = np.random.default_rng(seed)
    arr = ArrayState(threading.RLock(), "adapter", "warm", (8, 16), "float32")
    records: list[dict[str, Any]] = []
    for _ in range(steps):
        how = rng.integers(0, 6)
        if how == 0:
            arr[int(rng.integers(-8, 8)), int(rng.integers(0, 16))] = rng.random()
        elif how == 1:  # a slice with a step, negative too
            arr[1:7:2, ::-3] = rng.random((3, 6))
        elif how == 2:  # fancy
            rows = rng.integers(0, 8, 5)
            arr[rows, rng.integers(0, 16, 5)] = rng.random(5)
        elif how == 3:
            idx = rng.integers(0, 128, 4)
            arr.update(idx, rng.random(4))
        elif how == 4:  # changed behind its back, then marked
            arr.unsafe_array()[2, 3:5] = 7.0
            arr.mark_dirty((2, slice(3, 5)))
        else:
            arr[arr.view() > 0.9] = 0.5  # a boolean mask
        if rng.integers(0, 2):
            records += capture_records(arr)
    records += capture_records(arr)
    if not records:
        return
    out = replay(records, "adapter")
    got = np.frombuffer(out["data"], dtype=out["dtype"]).reshape(out["shape"])
    np.testing.assert_array_equal(got, arr.view())
    out = twice(records, "adapter")
    np.testing.assert_array_equal(
        np.frombuffer(out["data"], dtype=out["dtype"]).reshape(out["shape"]), arr.view()
    )


def test_array_capture_is_sparse_until_most_of_it_changed(capture_records: Capture) -> None:
    arr = ArrayState(threading.RLock(), "w", "warm", 1000, "float64")
    arr.update([3, 3, 500], [1.0, 2.0, 3.0])
    (rec,) = capture_records(arr)
    assert rec["o"] == "sparse"
    assert np.frombuffer(rec["idx"], "<i8").tolist() == [3, 500]  # deduplicated
    assert np.frombuffer(rec["val"], "<f8").tolist() == [2.0, 3.0]
    arr[0:600] = 1.0
    (rec,) = capture_records(arr)
    assert rec["o"] == "full" and len(rec["data"]) == 8000
    assert capture_records(arr) == []


def test_large_arrays_and_vectors_are_split_under_the_record_limit(
    monkeypatch: pytest.MonkeyPatch, capture_records: Capture
) -> None:
    monkeypatch.setattr(codec, "MAX_RECORD_BYTES", 1000)
    arr = ArrayState(threading.RLock(), "w", "warm", (50, 20), "float32", initial=np.arange(1000))
    records = capture_records(arr)
    assert len(records) > 1 and {r["o"] for r in records} == {"slice"}
    out = replay(records, "w")
    np.testing.assert_array_equal(np.frombuffer(out["data"], "<f4"), np.arange(1000))
    assert codec.full_records("w", "array", "warm", out, max_bytes=1000)[0]["o"] == "slice"

    vec = VectorIndex(threading.RLock(), "idx", "warm", 16)
    vec.upsert([f"v{i}" for i in range(100)], np.ones((100, 16)))
    records = capture_records(vec)
    assert len(records) > 1 and records[0]["o"] == "full"
    assert len(replay(records, "idx")["rows"]) == 100

    blob = Blob(threading.RLock(), "base", "cold")
    blob.set(bytes(range(256)) * 20)
    records = capture_records(blob)
    assert len(records) > 1 and {r["o"] for r in records} == {"part"}
    assert replay(records, "base")["data"] == bytes(range(256)) * 20


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["up", "rm", "capture"]), st.lists(st.integers(0, 9), max_size=4)
        ),
        max_size=20,
    )
)
def test_vector_upserts_and_removes_replay(
    ops: list[tuple[str, list[int]]], capture_records: Capture
) -> None:
    vec = VectorIndex(threading.RLock(), "idx", "warm", 4)
    records: list[dict[str, Any]] = []
    rng = np.random.default_rng(len(ops))
    for op, keys in ops:
        ids = list(dict.fromkeys(f"k{k}" for k in keys))
        if op == "up":
            vec.upsert(ids, rng.random((len(ids), 4)))
        elif op == "rm":
            vec.remove(ids)
        else:
            records += capture_records(vec)
    records += capture_records(vec)
    if not records:
        assert len(vec) == 0
        return
    assert replay(records, "idx")["rows"] == vec.value()["rows"]
    assert twice(records, "idx")["rows"] == vec.value()["rows"]


def test_vector_search_finds_the_nearest() -> None:
    vec = VectorIndex(threading.RLock(), "idx", "warm", 3)
    vec.upsert(["x", "y", "z"], [[1, 0, 0], [0, 1, 0], [0.9, 0.1, 0]])
    assert [i for i, _ in vec.search([1, 0, 0], k=2)] == ["x", "z"]
    vec.remove(["x"])
    assert vec.search([1, 0, 0], k=1)[0][0] == "z"
    assert len(vec) == 2 and "x" not in vec


def test_blob_is_sent_once_per_change_and_verified(capture_records: Capture) -> None:
    blob = Blob(threading.RLock(), "cfg", "cold")
    assert capture_records(blob) == []
    digest = blob.set(b"base config")
    (rec,) = capture_records(blob)
    assert rec["hash"] == digest == blake3.blake3(b"base config").hexdigest()
    assert capture_records(blob) == []
    assert replay([rec], "cfg")["data"] == b"base config"
    with pytest.raises(codec.CodecError, match="BLAKE3"):
        codec.apply(None, {**rec, "data": b"tampered"})


def test_bad_records_are_located_errors() -> None:
    with pytest.raises(codec.CodecError, match=r"'w'.*unknown record"):
        codec.apply(None, {"c": "w", "k": "array", "o": "nope"})
    sparse = {
        "c": "w",
        "k": "array",
        "t": "warm",
        "o": "sparse",
        "dtype": "<f4",
        "shape": [4],
        "idx": np.array([9], "<i8").tobytes(),
        "val": np.array([1], "<f4").tobytes(),
    }
    with pytest.raises(codec.CodecError, match="out of range"):
        codec.apply(None, sparse)
    base = codec.apply(None, {**sparse, "idx": np.array([1], "<i8").tobytes()})
    with pytest.raises(codec.CodecError, match="does not fit"):
        codec.apply(base, {**sparse, "shape": [5]})


def test_codec_needs_no_numpy_for_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keeper may merge without numpy: the pure-Python path gives the same bytes."""
    rec = {
        "c": "w",
        "k": "array",
        "t": "warm",
        "o": "sparse",
        "dtype": "<i4",
        "shape": [2, 3],
        "idx": np.array([0, 5], "<i8").tobytes(),
        "val": np.array([7, -1], "<i4").tobytes(),
    }
    with_numpy = codec.apply(None, rec)
    monkeypatch.setattr(codec, "_numpy", lambda: None)
    assert codec.apply(None, rec)["data"] == with_numpy["data"]
    assert np.frombuffer(with_numpy["data"], "<i4").tolist() == [7, 0, 0, 0, 0, -1]


def test_batches_stay_under_the_size() -> None:
    records = [{"c": "b", "k": "blob", "o": "full", "data": b"x" * 400, "hash": ""}] * 10
    groups = codec.batches(records, max_bytes=1000)
    assert sum(len(g) for g in groups) == 10 and all(len(g) <= 2 for g in groups)


def test_many_small_writes_are_all_captured(capture_records: Capture) -> None:
    arr = ArrayState(threading.RLock(), "w", "warm", 100_000, "int32")
    rng = np.random.default_rng(3)
    for i in rng.integers(0, 100_000, 3000):
        arr[int(i)] = int(i)
    records = capture_records(arr)
    out = replay(records, "w")
    np.testing.assert_array_equal(np.frombuffer(out["data"], "<i4"), arr.view())


def test_log_items_sent_again_or_late_are_kept_once_in_order() -> None:
    a, b, c = (["id-1", "h", "a"], ["id-2", "h", "b"], ["id-3", "h", "c"])
    rec = {"c": "h", "k": "log", "t": "hot", "o": "append"}
    log = codec.apply(None, {**rec, "items": [a, c]})
    log = codec.apply(log, {**rec, "items": [b, c]})  # b late (a refused checkpoint resent)
    assert log == [a, b, c]
