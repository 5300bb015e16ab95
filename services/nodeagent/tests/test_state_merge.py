"""The keeper's merge of state records into full records, and sealing (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from dsec_nodeagent.state.keeper import chunk_aad
from dsec_nodeagent.state.merge import Merged, RecordError, merge, split_large
from dsec_nodeagent.state.sealing import SealError, open_sealed, seal

pytestmark = pytest.mark.unit


def _full(name: str, arr: np.ndarray) -> dict[str, object]:
    return {
        "c": name,
        "k": "array",
        "t": "warm",
        "o": "full",
        "dtype": arr.dtype.str,
        "shape": list(arr.shape),
        "data": arr.tobytes(),
    }


def test_a_large_array_travels_as_slices_that_merge_back_to_it() -> None:
    arr = np.arange(3_000_000, dtype=np.float32).reshape(1000, 3000)  # 12 MB
    parts = list(split_large(_full("adapter", arr), limit=1 << 20))
    assert len(parts) == 12 and all(p["o"] == "slice" and "data" not in p for p in parts)
    assert all(len(p["val"]) <= 1 << 20 for p in parts)  # type: ignore[arg-type]
    (back,) = merge(parts)
    assert back["o"] == "full" and back["shape"] == [1000, 3000]
    assert np.array_equal(np.frombuffer(back["data"], dtype=np.float32).reshape(1000, 3000), arr)  # type: ignore[arg-type]
    small = _full("small", np.zeros(4, dtype=np.float32))
    assert list(split_large(small)) == [small]


def test_sparse_deltas_log_kv_and_vectors_fold_into_full_records() -> None:
    arr = np.zeros(10, dtype=np.float64)
    merged = Merged()
    merged.apply(_full("w", arr))
    merged.apply(
        {
            "c": "w",
            "k": "array",
            "t": "warm",
            "o": "sparse",
            "dtype": "<f8",
            "shape": [10],
            "idx": np.array([2, 9], dtype=np.int64).tobytes(),
            "val": np.array([1.5, -1.0]).tobytes(),
        }
    )
    merged.apply({"c": "h", "k": "log", "t": "hot", "o": "append", "items": [["1", "h", "a"]]})
    merged.apply({"c": "h", "k": "log", "t": "hot", "o": "append", "items": [["2", "h", "b"]]})
    merged.apply({"c": "m", "k": "kv", "t": "hot", "o": "set", "items": {"x": 1, "y": 2}})
    merged.apply({"c": "m", "k": "kv", "t": "hot", "o": "del", "keys": ["x"]})
    vec = np.ones((2, 3), dtype=np.float32)
    merged.apply(
        {
            "c": "v",
            "k": "vectors",
            "t": "warm",
            "o": "upsert",
            "dim": 3,
            "dtype": "<f4",
            "ids": ["a", "b"],
            "vec": vec.tobytes(),
        }
    )
    merged.apply({"c": "v", "k": "vectors", "t": "warm", "o": "remove", "ids": ["a"]})
    out = {r["c"]: r for r in merged.full_records()}
    w = np.frombuffer(out["w"]["data"], dtype=np.float64)
    assert w[2] == 1.5 and w[9] == -1.0 and w.sum() == 0.5
    assert [i[0] for i in out["h"]["items"]] == ["1", "2"]
    assert out["m"]["items"] == {"y": 2}
    assert out["v"]["ids"] == ["b"] and len(out["v"]["vec"]) == 12


def test_blob_parts_and_a_repeated_log_append_fold_like_the_sdk_codec() -> None:
    data = bytes(range(256)) * 10
    merged = Merged()
    for offset in range(0, len(data), 1000):
        merged.apply(
            {
                "c": "b",
                "k": "blob",
                "t": "cold",
                "o": "part",
                "offset": offset,
                "size": len(data),
                "hash": "h",
                "data": data[offset : offset + 1000],
            }
        )
    append = {"c": "h", "k": "log", "t": "hot", "o": "append", "items": [["01", "x", 1]]}
    merged.apply(append)
    merged.apply(append)  # a checkpoint sent again after a lost ack
    out = {r["c"]: r for r in merged.full_records()}
    assert out["b"]["o"] == "full" and out["b"]["data"] == data
    assert out["h"]["items"] == [["01", "x", 1]]


def test_a_sparse_index_outside_the_array_is_a_located_error() -> None:
    merged = Merged()
    merged.apply(_full("w", np.zeros(4, dtype=np.float32)))
    bad = {
        "c": "w",
        "k": "array",
        "t": "warm",
        "o": "sparse",
        "dtype": "<f4",
        "shape": [4],
        "idx": np.array([4], dtype=np.int64).tobytes(),
        "val": np.array([1.0], dtype=np.float32).tobytes(),
    }
    with pytest.raises(RecordError, match="'w'"):
        merged.apply(bad)


def test_a_sealed_chunk_opens_only_in_its_place() -> None:
    key = bytes(range(32))
    aad = chunk_aad("dsec_state.t.g.a", 3, 0, 2)
    sealed = seal(key, b"deltas", aad)
    assert open_sealed(key, sealed, aad, "chunk") == b"deltas"
    for other in (chunk_aad("dsec_state.t.g.a", 4, 0, 2), chunk_aad("dsec_state.t.g.b", 3, 0, 2)):
        with pytest.raises(SealError, match="does not authenticate"):
            open_sealed(key, sealed, other, "chunk")
    with pytest.raises(SealError):
        open_sealed(bytes(32), sealed, aad, "chunk")
