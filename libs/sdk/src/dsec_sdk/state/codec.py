"""Records -> values: how one container's change (a record, see :mod:`dsec_sdk.state.wire`) is
applied to its value, and how a value is written back as full records.

Both sides use it: the SDK to restore an agent's containers, the node agent's keeper to merge
warm snapshots (``fold``) and to send them back (``full_records``). It imports no numpy at
module level (the keeper may run without it): values are plain Python; numpy is used, when it
is importable, only to apply array and vector records faster.

Values, per kind::

    log      list of [id: str, blake3_hex: str, value]
    kv       dict {key: value}
    array    {"dtype": str, "shape": [int], "data": bytearray}   (C order)
    vectors  {"dim": int, "dtype": str, "rows": {id: bytes}}     (insertion order)
    blob     {"data": bytes, "hash": blake3_hex}
    ref      {"ref": blake3_hex, "size": int}     (a cold value kept in the object store)

Additive to the wire contract (records the SDK writes when a value is too large for one frame;
each stays far below ``wire.MAX_FRAME``)::

    kind "array" o "slice": "dtype", "shape", "start": int (flat element), "val": bytes
    kind "blob"  o "part":  "offset": int, "size": int (total), "hash": blake3_hex, "data": bytes

Every op is idempotent (a checkpoint sent again after a lost ack changes nothing): a log append
skips the ids the log has and keeps it in id order (ids are time-ordered, UUIDv7).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any, Final

import blake3
import msgpack

from dsec_sdk.state import msgcount

MAX_RECORD_BYTES: Final = 16 << 20
"""Full values larger than this are written as several records (``full_records``)."""
MAX_ITEM_OBJECTS: Final = msgcount.MAX_FRAME_OBJECTS // 4
"""The most MessagePack objects one log item or kv value may hold (each number, string, list
and map key is one): records of many items are cut to fit a frame (:func:`split_packed`), one
item is not."""
RECORD_OBJECTS: Final = msgcount.MAX_FRAME_OBJECTS // 2
"""A record of more objects than this is cut into several (:func:`split_packed`)."""

_DTYPE_RE: Final = re.compile(r"^[<>|=]?([biufc])(\d+)\Z")


class CodecError(ValueError):
    """A record that cannot be applied (unknown kind or op, mismatched shape or dtype)."""


def canonical(value: Any) -> Any:
    """``value`` with every dict's keys sorted (so equal values pack to equal bytes)."""
    if isinstance(value, dict):
        return {k: canonical(value[k]) for k in sorted(value, key=_key_order)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def _key_order(key: Any) -> tuple[str, str]:
    return (type(key).__name__, str(key))


def pack_canonical(value: Any) -> bytes:
    """The canonical MessagePack of ``value`` (raises ``TypeError`` for a value it can't pack)."""
    data: bytes = msgpack.packb(canonical(value), use_bin_type=True)
    return data


_STORABLE: Final = (
    "a stored value is made of str, int, float, bool, None, bytes, lists and dicts with str keys"
)


def check_item(body: bytes, what: str) -> None:
    """Refuse (``ValueError``, naming ``what``) a packed log item or kv value the keeper would
    refuse in a checkpoint frame: a dict key that is not a str (or bytes), or more than
    :data:`MAX_ITEM_OBJECTS` objects."""
    try:
        objects = msgcount.count(body, MAX_ITEM_OBJECTS, strict=True)
    except ValueError as exc:
        # (the count's place, "at object N", means nothing to whoever stored the value)
        problem = str(exc).split(" at object ")[0]
        raise ValueError(f"{what}: {problem}; {_STORABLE}") from None
    if objects > MAX_ITEM_OBJECTS:
        raise ValueError(
            f"{what}: the value holds more than {MAX_ITEM_OBJECTS:,} MessagePack objects (each "
            "number, string, list, map and key is one), more than a checkpoint frame may carry "
            "for one item; keep many numbers in an array container, or pack the value into "
            "bytes"
        )


def content_hash(value: Any) -> str:
    """BLAKE3 (hex) of the canonical MessagePack of ``value``."""
    return blake3.blake3(pack_canonical(value)).hexdigest()


def itemsize(dtype: str) -> int:
    """Bytes per element of a numeric dtype string (``<f4``, ``|u1``...)."""
    m = _DTYPE_RE.match(dtype)
    if m is None:
        raise CodecError(f"dtype {dtype!r} is not a numeric dtype string like '<f4'")
    return int(m.group(2))


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # the keeper without numpy: the pure-Python paths
        return None
    return numpy


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---------------------------------------------------------------------------------- apply
def apply(value: Any, record: dict[str, Any]) -> Any:
    """Apply one record to a container's value (``None``: the container has none yet) and
    return the new value (the old one may be changed in place).

    Raises:
        CodecError: The record does not fit the value or the contract.
    """
    kind = record.get("k")
    op = record.get("o")
    name = record.get("c")
    try:
        handler = _APPLY[(str(kind), str(op))]
    except (KeyError, TypeError):
        raise CodecError(f"container {name!r}: unknown record kind/op {kind!r}/{op!r}") from None
    try:
        return handler(value, record)
    except CodecError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CodecError(f"container {name!r}: bad {kind}/{op} record: {exc}") from exc


def _log_append(value: Any, r: dict[str, Any]) -> Any:
    return log_append(value if isinstance(value, list) else [], r["items"])


def log_append(log: list[Any], items: Any) -> list[Any]:
    """``log`` (kept in id order, each id once) with ``items`` (``[id, ...]``) added: an item
    sent again changes nothing, a late one goes to its place (the state keeper merges so too)."""
    for item in items:
        item_id = item[0]
        if not log or item_id > log[-1][0]:
            log.append(list(item))
            continue
        # an item sent again (a lost ack), or one of a checkpoint refused and sent again after
        # a later one was accepted: keep the log in id order, each id once
        pos = bisect.bisect_left(log, item_id, key=_item_id)
        if pos == len(log) or log[pos][0] != item_id:
            log.insert(pos, list(item))
    return log


def _item_id(item: Any) -> Any:
    return item[0]


def _log_full(value: Any, r: dict[str, Any]) -> Any:
    return [list(item) for item in r["items"]]


def _kv_set(value: Any, r: dict[str, Any]) -> Any:
    kv: dict[Any, Any] = value if isinstance(value, dict) else {}
    kv.update(r["items"])
    return kv


def _kv_del(value: Any, r: dict[str, Any]) -> Any:
    kv: dict[Any, Any] = value if isinstance(value, dict) else {}
    for key in r["keys"]:
        kv.pop(key, None)
    return kv


def _kv_full(value: Any, r: dict[str, Any]) -> Any:
    return dict(r["items"])


def _array_base(value: Any, r: dict[str, Any]) -> dict[str, Any]:
    dtype = r["dtype"]
    shape = [int(d) for d in r["shape"]]
    size = itemsize(dtype)
    if (
        isinstance(value, dict)
        and value.get("dtype") == dtype
        and [int(d) for d in value.get("shape", ())] == shape
    ):
        data = value["data"]
        if not isinstance(data, (bytearray, memoryview)) or (
            isinstance(data, memoryview) and data.readonly
        ):
            data = bytearray(data)
        return {"dtype": dtype, "shape": shape, "data": data}
    if value is not None and r["o"] != "full":
        raise CodecError(
            f"container {r.get('c')!r}: a {r['o']} record of {dtype}{shape} does not fit "
            f"the value {value.get('dtype') if isinstance(value, dict) else type(value)}"
            f"{value.get('shape') if isinstance(value, dict) else ''}"
        )
    return {"dtype": dtype, "shape": shape, "data": bytearray(_count(shape) * size)}


def _array_sparse(value: Any, r: dict[str, Any]) -> Any:
    out = _array_base(value, r)
    size = itemsize(out["dtype"])
    idx_b, val_b = r["idx"], r["val"]
    if len(idx_b) % 8 or len(val_b) != len(idx_b) // 8 * size:
        raise CodecError(f"container {r.get('c')!r}: sparse idx/val lengths do not match")
    n = _count(out["shape"])
    np = _numpy()
    if np is not None:
        flat = np.frombuffer(out["data"], dtype=out["dtype"])
        idx = np.frombuffer(idx_b, dtype="<i8")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise CodecError(f"container {r.get('c')!r}: a sparse index out of range 0..{n}")
        flat[idx] = np.frombuffer(val_b, dtype=out["dtype"])
        return out
    data = out["data"]
    for j, (i,) in enumerate(_iter_i64(idx_b)):
        if not 0 <= i < n:
            raise CodecError(f"container {r.get('c')!r}: a sparse index out of range 0..{n}")
        data[i * size : (i + 1) * size] = val_b[j * size : (j + 1) * size]
    return out


def _iter_i64(data: bytes) -> Any:
    import struct

    return struct.iter_unpack("<q", data)


def _array_slice(value: Any, r: dict[str, Any]) -> Any:
    out = _array_base(value, r)
    size = itemsize(out["dtype"])
    start = int(r["start"]) * size
    val = r["val"]
    if start < 0 or start + len(val) > len(out["data"]) or len(val) % size:
        raise CodecError(f"container {r.get('c')!r}: a slice outside the array")
    out["data"][start : start + len(val)] = val
    return out


def _array_full(value: Any, r: dict[str, Any]) -> Any:
    shape = [int(d) for d in r["shape"]]
    data = r["data"]
    if len(data) != _count(shape) * itemsize(r["dtype"]):
        raise CodecError(f"container {r.get('c')!r}: full array data has the wrong length")
    return {"dtype": r["dtype"], "shape": shape, "data": bytearray(data)}


def _vectors_base(value: Any, r: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict) and "rows" in value:
        if "dim" in r and (int(r["dim"]) != value["dim"] or r["dtype"] != value["dtype"]):
            raise CodecError(
                f"container {r.get('c')!r}: vectors of {r['dim']}x{r['dtype']} do not fit "
                f"an index of {value['dim']}x{value['dtype']}"
            )
        return value
    return {"dim": int(r.get("dim", 0)), "dtype": r.get("dtype", "<f4"), "rows": {}}


def _vectors_upsert(value: Any, r: dict[str, Any]) -> Any:
    out = _vectors_base(value, r)
    ids = r["ids"]
    row = out["dim"] * itemsize(out["dtype"])
    vec = r["vec"]
    if len(vec) != len(ids) * row:
        raise CodecError(f"container {r.get('c')!r}: {len(ids)} ids but {len(vec)} vector bytes")
    rows = out["rows"]
    for j, vid in enumerate(ids):
        rows[vid] = bytes(vec[j * row : (j + 1) * row])
    return out


def _vectors_remove(value: Any, r: dict[str, Any]) -> Any:
    out = _vectors_base(value, r)
    for vid in r["ids"]:
        out["rows"].pop(vid, None)
    return out


def _vectors_full(value: Any, r: dict[str, Any]) -> Any:
    return _vectors_upsert({"dim": int(r["dim"]), "dtype": r["dtype"], "rows": {}}, r)


def _blob_full(value: Any, r: dict[str, Any]) -> Any:
    data = bytes(r["data"])
    if blake3.blake3(data).hexdigest() != r["hash"]:
        raise CodecError(f"container {r.get('c')!r}: blob data does not match its BLAKE3 hash")
    return {"data": data, "hash": r["hash"]}


def _blob_part(value: Any, r: dict[str, Any]) -> Any:
    offset, total = int(r["offset"]), int(r["size"])
    if offset == 0 or not (isinstance(value, dict) and "parts" in value):
        if offset != 0:
            raise CodecError(f"container {r.get('c')!r}: blob part at {offset} without a start")
        value = {"parts": bytearray(), "hash": r["hash"], "size": total}
    if len(value["parts"]) != offset or value["hash"] != r["hash"]:
        raise CodecError(f"container {r.get('c')!r}: blob part at {offset} out of order")
    value["parts"] += r["data"]
    if len(value["parts"]) >= total:
        return _blob_full(None, {"c": r.get("c"), "data": value["parts"], "hash": r["hash"]})
    return value


def _ref_cold(value: Any, r: dict[str, Any]) -> Any:
    return {"ref": r["hash"], "size": int(r["size"])}


_APPLY: Final = {
    ("log", "append"): _log_append,
    ("log", "full"): _log_full,
    ("kv", "set"): _kv_set,
    ("kv", "del"): _kv_del,
    ("kv", "full"): _kv_full,
    ("array", "sparse"): _array_sparse,
    ("array", "slice"): _array_slice,
    ("array", "full"): _array_full,
    ("vectors", "upsert"): _vectors_upsert,
    ("vectors", "remove"): _vectors_remove,
    ("vectors", "full"): _vectors_full,
    ("blob", "full"): _blob_full,
    ("blob", "part"): _blob_part,
    ("ref", "cold"): _ref_cold,
}


# ---------------------------------------------------------------------------------- fold
@dataclass
class Entry:
    """One container's merged state: its kind (of the last record), tier and value."""

    kind: str
    tier: str
    value: Any


def fold(records: Any, into: dict[str, Entry] | None = None) -> dict[str, Entry]:
    """Apply records in order; the result maps each container name to its :class:`Entry`."""
    out = into if into is not None else {}
    for r in records:
        name = r.get("c")
        if not isinstance(name, str):
            raise CodecError(f"a record without a container name: {sorted(r)}")
        entry = out.get(name)
        value = apply(entry.value if entry is not None else None, r)
        kind = str(r["k"])
        out[name] = Entry(kind=kind, tier=str(r.get("t", "hot")), value=value)
    return out


def full_record(
    container: Any, kind: str | None = None, tier: str | None = None, value: Any = None
) -> dict[str, Any]:
    """One record that sets a container to its whole value.

    Either ``full_record(container)`` with an SDK container (or an :class:`Entry` plus its name
    as ``full_record(name, entry.kind, entry.tier, entry.value)``). Large values: prefer
    :func:`full_records`, which splits them under :data:`MAX_RECORD_BYTES`.
    """
    records = full_records(container, kind, tier, value, max_bytes=None)
    if len(records) != 1:  # pragma: no cover - max_bytes=None never splits
        raise CodecError("a value that needs several records")
    return records[0]


def full_records(
    container: Any,
    kind: str | None = None,
    tier: str | None = None,
    value: Any = None,
    *,
    max_bytes: int | None = MAX_RECORD_BYTES,
) -> list[dict[str, Any]]:
    """Records that, applied in order to nothing, give the container's whole value; each
    holds at most about ``max_bytes`` of array/vector/blob data (``None``: one record)."""
    if isinstance(container, str):
        name = container
        if kind is None or tier is None:
            raise TypeError("full_records(name, kind, tier, value): kind and tier are needed")
    else:
        name, kind, tier, value = container.name, container.kind, container.tier, None
        value = container.value()
    if isinstance(value, dict) and "parts" in value:
        raise CodecError(f"container {name!r}: an incomplete blob (parts missing)")
    head = {"c": name, "k": kind, "t": tier}
    limit = max_bytes if max_bytes is not None else 1 << 62
    if kind == "log":
        return [{**head, "o": "full", "items": [list(i) for i in value or []]}]
    if kind == "kv":
        return [{**head, "o": "full", "items": dict(value or {})}]
    if kind == "array":
        data = value["data"]
        meta = {"dtype": value["dtype"], "shape": list(value["shape"])}
        if len(data) <= limit:
            return [{**head, "o": "full", **meta, "data": bytes(data)}]
        size = itemsize(value["dtype"])
        step = max(1, limit // size) * size
        view = memoryview(data)
        return [
            {
                **head,
                "o": "slice",
                **meta,
                "start": off // size,
                "val": bytes(view[off : off + step]),
            }
            for off in range(0, len(data), step)
        ]
    if kind == "vectors":
        rows = value["rows"]
        meta = {"dim": value["dim"], "dtype": value["dtype"]}
        row = max(1, value["dim"] * itemsize(value["dtype"]))
        per = max(1, limit // row)
        ids = list(rows)
        out: list[dict[str, Any]] = []
        for j in range(0, max(len(ids), 1), per):
            chunk = ids[j : j + per]
            op = "full" if j == 0 else "upsert"
            out.append(
                {**head, "o": op, **meta, "ids": chunk, "vec": b"".join(rows[i] for i in chunk)}
            )
        return out
    if kind == "blob":
        data = value["data"]
        if len(data) <= limit:
            return [{**head, "o": "full", "data": bytes(data), "hash": value["hash"]}]
        return [
            {
                **head,
                "o": "part",
                "offset": off,
                "size": len(data),
                "hash": value["hash"],
                "data": bytes(data[off : off + limit]),
            }
            for off in range(0, len(data), limit)
        ]
    if kind == "ref":
        return [{**head, "o": "cold", "hash": value["ref"], "size": value["size"]}]
    raise CodecError(f"container {name!r}: unknown kind {kind!r}")


def snapshot(
    entries: dict[str, Entry], max_bytes: int | None = MAX_RECORD_BYTES
) -> list[dict[str, Any]]:
    """Full records of every entry (a warm snapshot)."""
    out: list[dict[str, Any]] = []
    for name, e in entries.items():
        out.extend(full_records(name, e.kind, e.tier, e.value, max_bytes=max_bytes))
    return out


def record_size(record: dict[str, Any]) -> int:
    """About how many bytes a record takes packed (its binary fields plus a small overhead;
    log and kv records are packed to measure)."""
    size = 64
    for key, v in record.items():
        if isinstance(v, (bytes, bytearray, memoryview)):
            size += len(v)
        elif key == "items":
            size += len(msgpack.packb(v, use_bin_type=True))
        elif key in ("ids", "keys"):
            size += sum(len(str(i)) + 2 for i in v)
    return size


# The field of a record that split_packed cuts, per kind and op, and the op of the pieces after
# the first ("full" then changes: applied in order, the same value).
_SPLIT_FIELD: Final = {
    ("kv", "set"): "items",
    ("kv", "full"): "items",
    ("kv", "del"): "keys",
    ("log", "append"): "items",
    ("log", "full"): "items",
    ("vectors", "upsert"): "ids",
    ("vectors", "full"): "ids",
    ("vectors", "remove"): "ids",
}
_AFTER_FULL: Final = {"kv": "set", "log": "append", "vectors": "upsert"}


def split_packed(body: bytes, max_objects: int = RECORD_OBJECTS) -> list[tuple[bytes, int]]:
    """A packed record as records of at most ``max_objects`` MessagePack objects each (with
    their counts), that give the same value applied in order: a log, kv or vectors record is cut
    between its items (a ``full`` one into a ``full`` and then ``append``/``set``/``upsert``
    records). ``CodecError``: a record of another kind, or one item alone over the bound (log
    items and kv values are held to :data:`MAX_ITEM_OBJECTS` as they are stored)."""
    total = msgcount.count(body, max_objects)
    if total <= max_objects:
        return [(body, total)]
    record = msgpack.unpackb(body, raw=False, strict_map_key=False)
    kind, op, name = record.get("k"), record.get("o"), record.get("c")
    field = _SPLIT_FIELD.get((kind, op))
    if field is None:
        raise CodecError(
            f"container {name!r}: a {kind} {op!r} record of more than {max_objects:,} "
            "MessagePack objects, which cannot be cut"
        )
    base = {k: v for k, v in record.items() if k not in (field, "vec")}
    room = max_objects - msgcount.count(_packb(base), max_objects) - 4  # (field, vec: k + v)
    items = record[field]
    if kind == "kv" and field == "items":
        parts: list[Any] = list(items.items())
        costs = [1 + msgcount.count(_packb(v), max_objects) for v in items.values()]
    elif kind == "log":
        parts = list(items)
        costs = [msgcount.count(_packb(item), max_objects) for item in items]
    else:  # ids or keys: strings
        parts = list(items)
        costs = [1] * len(parts)
    row = len(record["vec"]) // max(len(parts), 1) if "vec" in record else 0
    out: list[tuple[bytes, int]] = []
    start, used = 0, 0
    for i, cost in enumerate([*costs, None]):
        if cost is not None and cost > room:
            raise CodecError(
                f"container {name!r}: one item of more than {room:,} MessagePack objects"
            )
        if cost is None or (used + cost > room and i > start):
            later = _AFTER_FULL[kind] if op == "full" else op
            piece = {**base, "o": later if out else op}
            chunk = parts[start:i]
            piece[field] = dict(chunk) if kind == "kv" and field == "items" else chunk
            if "vec" in record:
                piece["vec"] = record["vec"][start * row : i * row]
            packed = _packb(piece)
            out.append((packed, msgcount.count(packed, max_objects)))
            start, used = i, 0
        if cost is not None:
            used += cost
    return out


def _packb(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def batches(
    records: list[dict[str, Any]], max_bytes: int = 3 * MAX_RECORD_BYTES
) -> list[list[dict[str, Any]]]:
    """Group records, in order, into batches of at most about ``max_bytes`` (one per frame)."""
    out: list[list[dict[str, Any]]] = []
    cur: list[dict[str, Any]] = []
    cur_size = 0
    for r in records:
        size = record_size(r)
        if cur and cur_size + size > max_bytes:
            out.append(cur)
            cur, cur_size = [], 0
        cur.append(r)
        cur_size += size
    if cur:
        out.append(cur)
    return out
