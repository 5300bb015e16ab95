"""Merging state records (``dsec_sdk.state.wire``) into each container's full record.

The keeper never needs an agent's Python values: it folds each container's deltas into one
``full`` record (what a warm snapshot holds). This is the keeper-side merge on the record
formats of the wire and of ``dsec_sdk.state.codec``'s additions for values too large for one
record, which it follows exactly:

* kind ``array`` op ``slice``: ``"dtype"``, ``"shape"``, ``"start"`` (flat element index, C
  order), ``"val"`` (a contiguous run of elements); the first one starts the array (zeros);
* kind ``blob`` op ``part``: ``"offset"``, ``"size"`` (total), ``"hash"``, ``"data"``, in order;
* a log ``append`` keeps the log in id order, each id once (ids are time-ordered strings), so
  a checkpoint sent again changes nothing (as ``dsec_sdk.state.codec`` folds it).

The keeper sends an array whose full record would pass :data:`PART_BYTES` as slices, so no
frame passes the wire's limit.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from dsec_sdk.state import codec

if TYPE_CHECKING:
    import numpy as np
else:

    class _Numpy:
        """numpy, imported at the first merge: a node agent whose agents keep no state does
        not carry it (its idle memory budget)."""

        def __getattr__(self, name: str) -> Any:
            module = importlib.import_module("numpy")
            globals()["np"] = module
            return getattr(module, name)

    np = _Numpy()

PART_BYTES: Final = 8 << 20


class RecordError(ValueError):
    """A record that breaks the wire's record format (names the container and field)."""


def _need(record: dict[str, Any], field: str, kind: type | tuple[type, ...]) -> Any:
    value = record.get(field)
    if not isinstance(value, kind):
        raise RecordError(
            f"record of container {record.get('c')!r} ({record.get('k')}/{record.get('o')}): "
            f"field {field!r} is missing or not {getattr(kind, '__name__', kind)}"
        )
    return value


def check(record: Any) -> dict[str, Any]:
    """The record if it has the common fields (``c``, ``k``, ``t``, ``o``)."""
    if not isinstance(record, dict):
        raise RecordError(f"a record must be a map, not {type(record).__name__}")
    for field in ("c", "k", "t", "o"):
        if not isinstance(record.get(field), str):
            raise RecordError(f"record {record.get('c')!r}: field {field!r} must be a string")
    if record["t"] not in ("hot", "warm", "cold"):
        raise RecordError(f"record {record['c']!r}: tier {record['t']!r} (hot, warm or cold)")
    return record


def itemsize(dtype: str) -> int:
    """Bytes an element of a numeric dtype string (``'<f4'``) takes, by the SDK's rule and as
    numpy makes it (``'<f3'`` has the shape of one, not a size); ``RecordError`` if none."""
    try:
        codec.itemsize(dtype)
        return int(np.dtype(dtype).itemsize)
    except (codec.CodecError, TypeError):
        raise RecordError(f"dtype {dtype!r} is not a numeric dtype like '<f4'") from None


def check_bounded(record: Any, max_bytes: int) -> dict[str, Any]:
    """:func:`check`, and the fields a merge sizes memory by, before anything is kept: an
    array's dtype is numeric and its shape holds at most ``max_bytes`` (the agent's
    ``state.max_size``); a log's items are ``[id, ...]`` with a string id; vectors ids and kv
    keys deleted are strings. A 305-byte
    checkpoint of sparse records made the warm merge allocate GiBs (its compressed snapshot,
    all the quota counted, was 33 KB)."""
    checked = record = check(record)
    if record["k"] == "array":
        dtype: str = _need(record, "dtype", str)
        try:
            item = itemsize(dtype)
        except RecordError as exc:
            raise RecordError(f"array {record['c']!r}: {exc}") from None
        shape = _need(record, "shape", (list, tuple))
        if not all(type(x) is int and x >= 0 for x in shape):
            raise RecordError(f"array {record['c']!r}: shape {shape!r:.80} (non-negative ints)")
        size = math.prod(shape) * item
        if size > max_bytes:
            raise RecordError(
                f"array {record['c']!r}: shape {list(shape)} of {dtype} is {size} bytes, over "
                f"this agent's state limit of {max_bytes} bytes"
            )
    elif record["k"] == "log" and record["o"] in ("append", "full"):
        for item in _need(record, "items", (list, tuple)):
            if not isinstance(item, (list, tuple)) or not item or type(item[0]) is not str:
                raise RecordError(f"log {record['c']!r}: an item must be [id, ...] with a str id")
    # (vectors ids and deleted kv keys end up in dicts: str, whose hashes are salted, as the
    # SDK sends them)
    field = _NAMED_BY.get(record["k"], "")
    named = record.get(field, ())
    if not isinstance(named, (list, tuple)) or not all(type(x) is str for x in named):
        raise RecordError(f"{record['k']} {record['c']!r}: {field} must be a list of strings")
    return checked


_NAMED_BY: Final = {"vectors": "ids", "kv": "keys"}


def _array(record: dict[str, Any]) -> np.ndarray:
    dtype = np.dtype(_need(record, "dtype", str))
    shape = tuple(int(x) for x in _need(record, "shape", (list, tuple)))
    size = int(np.prod(shape)) if shape else 1
    data = record.get("data")
    if isinstance(data, bytes) and record["o"] == "full":
        if len(data) != size * dtype.itemsize:
            raise RecordError(
                f"array {record['c']!r}: {len(data)} bytes of data for shape {list(shape)} "
                f"of {dtype.name} ({size * dtype.itemsize} expected)"
            )
        return np.frombuffer(data, dtype=dtype).copy()
    return np.zeros(size, dtype=dtype)


def _array_record(name: str, tier: str, arr: np.ndarray, shape: list[int]) -> dict[str, Any]:
    return {
        "c": name,
        "k": "array",
        "t": tier,
        "o": "full",
        "dtype": arr.dtype.str,
        "shape": shape,
        "data": arr.tobytes(),
    }


class Merged:
    """Each container's current value as a full record, folded from records in order."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self._arrays: dict[str, tuple[np.ndarray, list[int], str]] = {}
        self._parts: dict[str, bytearray] = {}  # blobs whose parts are still arriving
        # Changes are folded into values held here, changed in place: a container's value was
        # copied whole for every record, so K small records cost K x its size (an adversarial
        # review: 10,000 one-row vectors upserts, a 0.65 MB checkpoint, merged in 47.5 s).
        self._owned: set[str] = set()  # log and kv records made here (theirs are not changed)
        self._vectors: dict[str, _Vectors] = {}

    def _apply_blob_part(self, record: dict[str, Any]) -> None:
        name = record["c"]
        offset = int(_need(record, "offset", int))
        total = int(_need(record, "size", int))
        data = _need(record, "data", bytes)
        if offset == 0:
            self._parts[name] = bytearray()
        held = self._parts.get(name)
        if held is None or len(held) != offset:
            raise RecordError(f"blob {name!r}: part at {offset} out of order")
        held += data
        if len(held) >= total:
            del self._parts[name]
            self.records[name] = {
                "c": name,
                "k": "blob",
                "t": record["t"],
                "o": "full",
                "data": bytes(held),
                "hash": _need(record, "hash", str),
            }

    def apply(self, record: dict[str, Any]) -> None:
        """Fold one record (full or delta) into its container."""
        record = check(record)
        name, kind, op = record["c"], record["k"], record["o"]
        if kind != "vectors":
            self._vectors.pop(name, None)
        if kind == "array":
            self._owned.discard(name)
            self._apply_array(record)
            return
        self._arrays.pop(name, None)
        if op == "full" or kind == "ref" or (kind == "blob" and op != "part"):
            self.records[name] = record
            self._owned.discard(name)
            self._vectors.pop(name, None)
            return
        if kind == "blob" and op == "part":
            self._owned.discard(name)
            self._apply_blob_part(record)
            return
        if kind == "log" and op == "append":
            held = self._held(name, "log", list)
            codec.log_append(held["items"], _need(record, "items", (list, tuple)))
            held["t"] = record["t"]
        elif kind == "kv" and op in ("set", "del"):
            held = self._held(name, "kv", dict)
            if op == "set":
                held["items"].update(_need(record, "items", dict))
            else:
                for key in _need(record, "keys", (list, tuple)):
                    held["items"].pop(key, None)
            held["t"] = record["t"]
        elif kind == "vectors" and op in ("upsert", "remove"):
            self._apply_vectors(record)
        else:
            raise RecordError(f"record {name!r}: unknown kind/op {kind}/{op}")

    def _held(self, name: str, kind: str, empty: type) -> dict[str, Any]:
        """``name``'s full record of ``kind``, made here (its items copied once from the one
        folded before, or empty), to change in place."""
        prev = self.records.get(name)
        if name in self._owned and prev is not None:
            return prev
        items = empty(prev["items"]) if prev is not None and prev.get("k") == kind else empty()
        held = {"c": name, "k": kind, "t": "hot", "o": "full", "items": items}
        self.records[name] = held
        self._owned.add(name)
        return held

    def _apply_array(self, record: dict[str, Any]) -> None:
        name, op = record["c"], record["o"]
        held = self._arrays.get(name)
        if op == "full" or held is None:
            arr = _array(record)
            shape = [int(x) for x in record["shape"]]
            held = (arr, shape, record["t"])
            self._arrays[name] = held
            if op == "full":
                self.records.pop(name, None)
                return
        arr, shape, tier = held
        if (
            np.dtype(_need(record, "dtype", str)) != arr.dtype
            or [int(x) for x in _need(record, "shape", (list, tuple))] != shape
        ):  # (as dsec_sdk.state.codec refuses it: never written into another array)
            raise RecordError(f"array {name!r}: a {op} record of another dtype or shape")
        try:
            if op == "sparse":
                idx = np.frombuffer(_need(record, "idx", bytes), dtype=np.int64)
                val = np.frombuffer(_need(record, "val", bytes), dtype=arr.dtype)
                if len(idx) != len(val) or (len(idx) and (idx.min() < 0 or idx.max() >= arr.size)):
                    raise RecordError(f"array {name!r}: sparse indices and values do not fit")
                arr[idx] = val
            elif op == "slice":
                start = int(_need(record, "start", int))
                data = np.frombuffer(_need(record, "val", bytes), dtype=arr.dtype)
                if start < 0 or start + len(data) > arr.size:
                    raise RecordError(
                        f"array {name!r}: slice {start}+{len(data)} outside the array"
                    )
                arr[start : start + len(data)] = data
        except ValueError as exc:  # (bytes that are no whole number of elements)
            if isinstance(exc, RecordError):
                raise
            raise RecordError(f"array {name!r}: {exc}") from None
        if op not in ("sparse", "slice", "full"):
            raise RecordError(f"array {name!r}: unknown op {op!r}")
        self.records.pop(name, None)
        self._arrays[name] = (arr, shape, tier)

    def _apply_vectors(self, record: dict[str, Any]) -> None:
        name = record["c"]
        held = self._vectors.get(name)
        if held is None:
            prev = self.records.pop(name, None)
            if prev is not None and prev.get("k") == "vectors":
                held = _Vectors(int(prev["dim"]), np.dtype(prev["dtype"]), {}, prev["t"])
                held.upsert(name, _need(prev, "ids", (list, tuple)), _need(prev, "vec", bytes))
            else:
                dim = int(_need(record, "dim", int))
                held = _Vectors(dim, np.dtype(_need(record, "dtype", str)), {}, record["t"])
            self._vectors[name] = held
        self._owned.discard(name)
        held.tier = record["t"]
        if record["o"] == "upsert":
            held.upsert(name, _need(record, "ids", (list, tuple)), _need(record, "vec", bytes))
        else:
            for key in _need(record, "ids", (list, tuple)):
                held.rows.pop(key, None)

    def full_records(self) -> list[dict[str, Any]]:
        """Every container's full record (arrays whole)."""
        out = list(self.records.values())
        for name, (arr, shape, tier) in self._arrays.items():
            out.append(_array_record(name, tier, arr, shape))
        for name, vectors in self._vectors.items():
            out.append(vectors.record(name))
        return out


@dataclass
class _Vectors:
    """A vectors container's value as a merge changes it: its rows by id, in order."""

    dim: int
    dtype: np.dtype[Any]
    rows: dict[str, bytes]
    tier: str

    def upsert(self, name: str, ids: Sequence[Any], vec: bytes) -> None:
        row = self.dim * self.dtype.itemsize
        if len(vec) != len(ids) * row:
            raise RecordError(
                f"vectors {name!r}: {len(ids)} ids, {len(vec)} bytes of rows of {row}"
            )
        for i, key in enumerate(ids):
            self.rows[key] = vec[i * row : (i + 1) * row]

    def record(self, name: str) -> dict[str, Any]:
        return {
            "c": name,
            "k": "vectors",
            "t": self.tier,
            "o": "full",
            "dim": self.dim,
            "dtype": self.dtype.str,
            "ids": list(self.rows),
            "vec": b"".join(self.rows.values()),
        }


def merge(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The full records after folding ``records`` in order."""
    merged = Merged()
    for record in records:
        merged.apply(record)
    return merged.full_records()


def split_large(record: dict[str, Any], limit: int = PART_BYTES) -> Iterator[dict[str, Any]]:
    """``record``, or, for an array full record of more than ``limit`` bytes, its slices."""
    data = record.get("data")
    if record.get("k") != "array" or record.get("o") != "full" or not isinstance(data, bytes):
        yield record
        return
    if len(data) <= limit:
        yield record
        return
    itemsize = np.dtype(record["dtype"]).itemsize
    step = max(1, limit // itemsize) * itemsize
    head = {k: v for k, v in record.items() if k != "data"}
    for offset in range(0, len(data), step):
        yield {
            **head,
            "o": "slice",
            "start": offset // itemsize,
            "val": data[offset : offset + step],
        }
