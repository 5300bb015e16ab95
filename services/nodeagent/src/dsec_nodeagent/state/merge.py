"""Merging state records (``dsec_sdk.state.wire``) into each container's full record.

The keeper never needs an agent's Python values: it folds each container's deltas into one
``full`` record (what a warm snapshot holds and what recovery sends first). This is the
keeper-side merge on the record formats of the wire; the SDK's ``codec`` applies the same
records to values.

Additive to the wire (large arrays): kind ``array`` op ``part`` — ``"dtype"``, ``"shape"``,
``"start"`` (flat element index, C order), ``"data"`` (a contiguous run of elements). A part with
``start`` 0 starts the array (zeros elsewhere); later parts fill it. The keeper sends an array
whose full record would pass :data:`PART_BYTES` as parts, so no frame passes the wire's limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Final

import numpy as np

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

    def apply(self, record: dict[str, Any]) -> None:
        """Fold one record (full or delta) into its container."""
        record = check(record)
        name, kind, op = record["c"], record["k"], record["o"]
        if kind == "array":
            self._apply_array(record)
            return
        self._arrays.pop(name, None)
        prev = self.records.get(name)
        if op == "full" or kind in ("blob", "ref"):
            self.records[name] = record
            return
        if kind == "log" and op == "append":
            items = list(prev["items"]) if prev and prev.get("k") == "log" else []
            items.extend(_need(record, "items", (list, tuple)))
            self.records[name] = {**record, "o": "full", "items": items}
        elif kind == "kv" and op in ("set", "del"):
            base = dict(prev["items"]) if prev and prev.get("k") == "kv" else {}
            if op == "set":
                base.update(_need(record, "items", dict))
            else:
                for key in _need(record, "keys", (list, tuple)):
                    base.pop(key, None)
            self.records[name] = {
                "c": name,
                "k": "kv",
                "t": record["t"],
                "o": "full",
                "items": base,
            }
        elif kind == "vectors" and op in ("upsert", "remove"):
            self._apply_vectors(record, prev)
        else:
            raise RecordError(f"record {name!r}: unknown kind/op {kind}/{op}")

    def _apply_array(self, record: dict[str, Any]) -> None:
        name, op = record["c"], record["o"]
        held = self._arrays.get(name)
        if op == "full" or (op == "part" and int(record.get("start", 0)) == 0) or held is None:
            arr = _array(record)
            shape = [int(x) for x in record["shape"]]
            held = (arr, shape, record["t"])
            self._arrays[name] = held
            if op == "full":
                self.records.pop(name, None)
                return
        arr, shape, tier = held
        if op == "sparse":
            idx = np.frombuffer(_need(record, "idx", bytes), dtype=np.int64)
            val = np.frombuffer(_need(record, "val", bytes), dtype=arr.dtype)
            if len(idx) != len(val) or (len(idx) and (idx.min() < 0 or idx.max() >= arr.size)):
                raise RecordError(f"array {name!r}: sparse indices and values do not fit")
            arr[idx] = val
        elif op == "part":
            start = int(record.get("start", 0))
            data = np.frombuffer(_need(record, "data", bytes), dtype=arr.dtype)
            if start < 0 or start + len(data) > arr.size:
                raise RecordError(f"array {name!r}: part {start}+{len(data)} outside the array")
            arr[start : start + len(data)] = data
        elif op != "full":
            raise RecordError(f"array {name!r}: unknown op {op!r}")
        self.records.pop(name, None)
        self._arrays[name] = (arr, shape, tier)

    def _apply_vectors(self, record: dict[str, Any], prev: dict[str, Any] | None) -> None:
        name = record["c"]
        if prev is not None and prev.get("k") == "vectors":
            dim, dtype = int(prev["dim"]), np.dtype(prev["dtype"])
            ids = list(prev["ids"])
            vec = np.frombuffer(prev["vec"], dtype=dtype).reshape(len(ids), dim)
        else:
            dim = int(_need(record, "dim", int))
            dtype = np.dtype(_need(record, "dtype", str))
            ids, vec = [], np.zeros((0, dim), dtype=dtype)
        rows = dict(zip(ids, vec, strict=True))
        if record["o"] == "upsert":
            new_ids = list(_need(record, "ids", (list, tuple)))
            new = np.frombuffer(_need(record, "vec", bytes), dtype=dtype).reshape(-1, dim)
            if len(new) != len(new_ids):
                raise RecordError(f"vectors {name!r}: {len(new_ids)} ids, {len(new)} rows")
            rows.update(zip(new_ids, new, strict=True))
        else:
            for key in _need(record, "ids", (list, tuple)):
                rows.pop(key, None)
        out_ids = list(rows)
        out = np.stack(list(rows.values())) if rows else np.zeros((0, dim), dtype=dtype)
        self.records[name] = {
            "c": name,
            "k": "vectors",
            "t": record["t"],
            "o": "full",
            "dim": dim,
            "dtype": dtype.str,
            "ids": out_ids,
            "vec": out.astype(dtype, copy=False).tobytes(),
        }

    def full_records(self) -> list[dict[str, Any]]:
        """Every container's full record (arrays whole)."""
        out = list(self.records.values())
        for name, (arr, shape, tier) in self._arrays.items():
            out.append(_array_record(name, tier, arr, shape))
        return out


def merge(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The full records after folding ``records`` in order."""
    merged = Merged()
    for record in records:
        merged.apply(record)
    return merged.full_records()


def split_large(record: dict[str, Any], limit: int = PART_BYTES) -> Iterator[dict[str, Any]]:
    """``record``, or, for an array full record of more than ``limit`` bytes, its parts."""
    data = record.get("data")
    if record.get("k") != "array" or record.get("o") != "full" or not isinstance(data, bytes):
        yield record
        return
    if len(data) <= limit:
        yield record
        return
    itemsize = np.dtype(record["dtype"]).itemsize
    step = max(1, limit // itemsize) * itemsize
    for offset in range(0, len(data), step):
        yield {
            **record,
            "o": "part",
            "start": offset // itemsize,
            "data": data[offset : offset + step],
        }
