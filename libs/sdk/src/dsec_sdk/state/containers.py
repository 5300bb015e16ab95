"""State containers that record their own changes (deltas).

Every mutation takes the owning :class:`~dsec_sdk.state.AgentState`'s lock and notes what
changed; a checkpoint's capture (under that lock: the agent's pause) copies only the changed
parts and resets the notes; packing happens after the lock is released. numpy is imported
only by :class:`ArrayState` and :class:`VectorIndex` (the ``dsec-sdk[state]`` extra).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import blake3
import msgpack

from dsec_sdk.state import codec
from dsec_sdk.state.store import StateError

if TYPE_CHECKING:
    import numpy as np

Thunk = Callable[[], list[bytes]]
"""Captured under the lock; called after it to pack the records."""

_FULL_FRACTION = 0.4  # dirty above this fraction of a container: a full record instead


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise ImportError(
            "dsec_sdk.state arrays and vectors need numpy: pip install 'dsec-sdk[state]'"
        ) from None
    return numpy


def _packb(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def _packed_thunk(record: dict[str, Any]) -> Thunk:
    return lambda: [_packb(record)]


class _Uuid7:
    """Time-ordered ids (RFC 9562 UUIDv7, a 12-bit counter within a millisecond): strictly
    increasing in this process, also after :meth:`observe` of a restored id."""

    def __init__(self) -> None:
        self._last = (0, 0)
        self._lock = threading.Lock()

    def next(self) -> str:
        ms = time.time_ns() // 1_000_000
        with self._lock:
            last_ms, ctr = self._last
            if ms <= last_ms:
                ms, ctr = last_ms, ctr + 1
                if ctr > 0xFFF:
                    ms, ctr = ms + 1, 0
            else:
                ctr = 0
            self._last = (ms, ctr)
        rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
        return str(uuid.UUID(int=(ms << 80) | (0x7 << 76) | (ctr << 64) | (0b10 << 62) | rand))

    def observe(self, value: str) -> None:
        try:
            n = uuid.UUID(value).int
        except ValueError:
            return
        seen = (n >> 80, (n >> 64) & 0xFFF)
        with self._lock:
            self._last = max(self._last, seen)


ids = _Uuid7()


class Container:
    """What every container has: a name, a kind, a tier, and the owner's lock."""

    kind: ClassVar[str]

    def __init__(self, lock: threading.RLock, name: str, tier: str) -> None:
        self._lock = lock
        self.name = name
        self.tier = tier

    def _head(self, op: str) -> dict[str, Any]:
        return {"c": self.name, "k": self.kind, "t": self.tier, "o": op}

    def _capture(self) -> list[Thunk]:  # pragma: no cover - abstract
        raise NotImplementedError

    def value(self) -> Any:  # pragma: no cover - abstract
        """The container's value as :mod:`dsec_sdk.state.codec` represents it."""
        raise NotImplementedError

    def _load(self, value: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _apply(self, record: dict[str, Any]) -> None:
        """Apply a record received from the keeper (already durable: nothing is marked)."""
        self._load(codec.apply(self.value(), record))

    def _params(self) -> tuple[Any, ...]:
        return ()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} tier={self.tier}>"


# ----------------------------------------------------------------------------------- log
class LogEntry(NamedTuple):
    id: str
    hash: str
    value: Any


class MessageLog(Container):
    """An append-only log (a conversation history, a tool call trail). Each item gets a
    time-ordered id (UUIDv7) and the BLAKE3 hash of its value's canonical MessagePack; a
    checkpoint sends only the items appended since the last one."""

    kind = "log"

    def __init__(self, lock: threading.RLock, name: str, tier: str) -> None:
        super().__init__(lock, name, tier)
        self._entries: list[LogEntry] = []
        self._packed: list[bytes] = []
        self._sent = 0

    def append(self, value: Any) -> str:
        """Append ``value`` (MessagePack-able: str, int, float, bool, None, bytes, lists,
        dicts with str keys); returns its id."""
        try:
            body = codec.pack_canonical(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(
                f"log {self.name!r}: cannot store {type(value).__name__}: {exc}"
            ) from None
        codec.check_item(body, f"log {self.name!r}")
        digest = blake3.blake3(body).hexdigest()
        with self._lock:
            item_id = ids.next()
            head = msgpack.Packer(use_bin_type=True)
            packed = head.pack_array_header(3) + head.pack(item_id) + head.pack(digest) + body
            self._entries.append(LogEntry(item_id, digest, value))
            self._packed.append(packed)
        return item_id

    def extend(self, values: Iterable[Any]) -> list[str]:
        """Append each value; their ids."""
        return [self.append(v) for v in values]

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: int) -> Any:
        return self._entries[i].value

    def __iter__(self) -> Iterator[Any]:
        return (e.value for e in list(self._entries))

    def entry(self, i: int) -> LogEntry:
        """Item ``i`` with its id and content hash."""
        return self._entries[i]

    def entries(self) -> list[LogEntry]:
        return list(self._entries)

    def _capture(self) -> list[Thunk]:
        n = len(self._packed)
        if self._sent >= n:
            return []
        chunk = self._packed[self._sent : n]
        self._sent = n
        head = self._head("append")

        def pack() -> list[bytes]:
            p = msgpack.Packer(use_bin_type=True)
            parts = [p.pack_map_header(len(head) + 1)]
            for k, v in head.items():
                parts += [p.pack(k), p.pack(v)]
            parts += [p.pack("items"), p.pack_array_header(len(chunk)), *chunk]
            return [b"".join(parts)]

        return [pack]

    def value(self) -> Any:
        return [[e.id, e.hash, e.value] for e in self._entries]

    def _load(self, value: Any) -> None:
        self._entries = []
        self._packed = []
        p = msgpack.Packer(use_bin_type=True)
        for item_id, digest, v in value or []:
            self._entries.append(LogEntry(item_id, digest, v))
            self._packed.append(
                p.pack_array_header(3) + p.pack(item_id) + p.pack(digest) + codec.pack_canonical(v)
            )
        self._sent = len(self._entries)
        if self._entries:
            ids.observe(self._entries[-1].id)

    def _apply(self, record: dict[str, Any]) -> None:
        if record.get("o") != "append":
            return super()._apply(record)
        p = msgpack.Packer(use_bin_type=True)
        for item_id, digest, v in record["items"]:
            packed = p.pack_array_header(3) + p.pack(item_id) + p.pack(digest)
            packed += codec.pack_canonical(v)
            if not self._entries or item_id > self._entries[-1].id:
                self._entries.append(LogEntry(item_id, digest, v))
                self._packed.append(packed)
                continue
            pos = bisect.bisect_left(self._entries, item_id, key=_entry_id)
            if pos == len(self._entries) or self._entries[pos].id != item_id:
                self._entries.insert(pos, LogEntry(item_id, digest, v))
                self._packed.insert(pos, packed)
        self._sent = len(self._entries)
        if self._entries:
            ids.observe(self._entries[-1].id)
        return None


def _entry_id(entry: LogEntry) -> str:
    return entry.id


# ------------------------------------------------------------------------------------ kv
class KVMap(Container, MutableMapping[str, Any]):
    """A key/value map (str keys, MessagePack-able values); a checkpoint sends the keys set
    and deleted since the last one."""

    kind = "kv"

    def __init__(self, lock: threading.RLock, name: str, tier: str) -> None:
        super().__init__(lock, name, tier)
        self._data: dict[str, Any] = {}
        self._packed: dict[str, bytes] = {}
        self._set: set[str] = set()
        self._del: set[str] = set()

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(f"kv {self.name!r}: keys are str, got {type(key).__name__}")
        try:
            packed = codec.pack_canonical(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(
                f"kv {self.name!r}[{key!r}]: cannot store {type(value).__name__}: {exc}"
            ) from None
        codec.check_item(packed, f"kv {self.name!r}[{key!r}]")
        with self._lock:
            self._data[key] = value
            self._packed[key] = packed
            self._set.add(key)
            self._del.discard(key)

    def __delitem__(self, key: str) -> None:
        with self._lock:
            del self._data[key]
            self._packed.pop(key, None)
            self._set.discard(key)
            self._del.add(key)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def _capture(self) -> list[Thunk]:
        out: list[Thunk] = []
        if self._del:
            out.append(_packed_thunk({**self._head("del"), "keys": sorted(self._del)}))
            self._del = set()
        if self._set:
            items = [(k, self._packed[k]) for k in self._set]
            self._set = set()
            head = self._head("set")

            def pack() -> list[bytes]:
                p = msgpack.Packer(use_bin_type=True)
                parts = [p.pack_map_header(len(head) + 1)]
                for k, v in head.items():
                    parts += [p.pack(k), p.pack(v)]
                parts += [p.pack("items"), p.pack_map_header(len(items))]
                for k, body in items:
                    parts += [p.pack(k), body]
                return [b"".join(parts)]

            out.append(pack)
        return out

    def value(self) -> Any:
        return dict(self._data)

    def _load(self, value: Any) -> None:
        self._data = dict(value or {})
        self._packed = {k: codec.pack_canonical(v) for k, v in self._data.items()}
        self._set, self._del = set(), set()


# --------------------------------------------------------------------------------- array
class ArrayState(Container):
    """A numpy array (adapter weights, counters) with sparse delta capture.

    Write through the container so changes are tracked: ``arr[idx] = v`` (any numpy index),
    ``arr.update(flat_indices, values)`` (the fast path), or change :meth:`unsafe_array` and
    call :meth:`mark_dirty`. Read with ``arr.view()`` (read-only) or ``arr[idx]``. A checkpoint
    copies the values at the changed indices (a ``sparse`` record: int64 flat indices +
    values); when more than ~40 % changed, the whole array (``full``).
    """

    kind = "array"

    def __init__(
        self,
        lock: threading.RLock,
        name: str,
        tier: str,
        shape: Sequence[int] | int,
        dtype: Any = "float32",
        initial: Any = None,
    ) -> None:
        super().__init__(lock, name, tier)
        np = _numpy()
        self._np = np
        shape_t = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        dt = np.dtype(dtype)
        if dt.kind not in "biufc" or not shape_t or any(d < 0 for d in shape_t):
            raise ValueError(
                f"array {name!r}: a numeric dtype (bool, int, uint, float, complex) and a shape "
                f"of at least one dimension are needed, got {dt} {shape_t}"
            )
        if initial is None:
            self._a = np.zeros(shape_t, dtype=dt)
        else:
            self._a = np.array(initial, dtype=dt, copy=True).reshape(shape_t)
        self._flat = self._a.reshape(-1)
        self._n = int(self._a.size)
        self._chunks: list[Any] = []
        self._count = 0
        self._all = initial is not None

    def _params(self) -> tuple[Any, ...]:
        return (self._a.shape, self._a.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._a.shape)

    @property
    def dtype(self) -> Any:
        return self._a.dtype

    def __len__(self) -> int:
        return len(self._a)

    def view(self) -> np.ndarray:
        """A read-only view of the array (no copy)."""
        v: np.ndarray = self._a.view()
        v.flags.writeable = False
        return v

    def unsafe_array(self) -> np.ndarray:
        """The array itself, writable: changes made through it are NOT tracked; call
        :meth:`mark_dirty` for them (under :attr:`AgentState.lock` if other threads checkpoint)."""
        a: np.ndarray = self._a
        return a

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        v = self.view()
        out: np.ndarray = v if dtype is None else v.astype(dtype)
        return out

    def __getitem__(self, idx: Any) -> Any:
        return self.view()[idx]

    def __setitem__(self, idx: Any, value: Any) -> None:
        flat = self._flat_indices(idx)
        with self._lock:
            self._a[idx] = value
            self._mark(flat)

    def update(self, indices: Any, values: Any) -> None:
        """Set the elements at ``indices`` (flat, C order) to ``values``."""
        idx = self._norm_flat(indices)
        with self._lock:
            self._flat[idx] = values
            self._mark(idx)

    def mark_dirty(self, index: Any = None, *, flat: bool = False) -> None:
        """Note elements changed behind the container's back: ``index`` as in ``arr[index]``
        (``None``: all), or flat indices with ``flat=True``."""
        marks = (
            None
            if index is None
            else (self._norm_flat(index) if flat else self._flat_indices(index))
        )
        with self._lock:
            self._mark(marks)

    def _norm_flat(self, indices: Any) -> Any:
        np = self._np
        if isinstance(indices, slice):
            return np.arange(*indices.indices(self._n), dtype=np.int64)
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (int(idx.min()) < -self._n or int(idx.max()) >= self._n):
            raise IndexError(f"array {self.name!r}: a flat index outside 0..{self._n - 1}")
        return np.where(idx < 0, idx + self._n, idx)

    def _flat_indices(self, idx: Any) -> Any:
        """The flat indices ``arr[idx]`` touches (``None``: treat as all)."""
        np = self._np
        a = self._a
        sub = a[idx]
        if isinstance(sub, np.ndarray) and sub.base is a:
            if sub.size > _FULL_FRACTION * self._n:
                return None
            item = a.itemsize
            start = (sub.__array_interface__["data"][0] - a.__array_interface__["data"][0]) // item
            out = np.full(sub.shape, start, dtype=np.int64)
            for d, (n, st) in enumerate(zip(sub.shape, sub.strides, strict=True)):
                shape = [1] * sub.ndim
                shape[d] = n
                out += (np.arange(n, dtype=np.int64) * (st // item)).reshape(shape)
            return out.reshape(-1)
        if not isinstance(sub, np.ndarray):  # one element
            parts = idx if isinstance(idx, tuple) else (idx,)
            norm = tuple(int(i) % d for i, d in zip(parts, a.shape, strict=False))
            return np.array([np.ravel_multi_index(norm, a.shape)], dtype=np.int64)
        if a.ndim == 1 and not isinstance(idx, tuple):
            arr = np.asarray(idx)
            if arr.dtype == bool:
                return np.flatnonzero(arr)
            if arr.dtype.kind in "iu":
                return self._norm_flat(arr)
        if isinstance(idx, np.ndarray) and idx.dtype == bool and idx.shape == a.shape:
            return np.flatnonzero(idx)
        return np.arange(self._n, dtype=np.int64).reshape(a.shape)[idx].reshape(-1)

    def _mark(self, idx: Any) -> None:
        if self._all:
            return
        if idx is None:
            self._all = True
            self._chunks = []
            return
        self._chunks.append(idx)
        self._count += len(idx)
        if self._count > _FULL_FRACTION * self._n:
            self._all = True
            self._chunks = []
        elif len(self._chunks) >= 1024:  # many small writes: merge now, not in the pause
            self._chunks = [self._np.concatenate(self._chunks)]

    def _capture(self) -> list[Thunk]:
        np = self._np
        meta = {"dtype": self._a.dtype.str, "shape": list(self._a.shape)}
        if self._all:
            data = self._a.tobytes()
            self._all, self._chunks, self._count = False, [], 0
            head = self._head("full")
            return [lambda: [_packb(r) for r in _array_full(head, meta, data, self._a.itemsize)]]
        if not self._chunks:
            return []
        idx = self._chunks[0] if len(self._chunks) == 1 else np.concatenate(self._chunks)
        vals = self._flat[idx]
        self._chunks, self._count = [], 0
        head = self._head("sparse")
        item = self._a.itemsize

        def pack() -> list[bytes]:
            uniq, first = np.unique(idx, return_index=True)
            v = vals[first]
            per = max(1, codec.MAX_RECORD_BYTES // (8 + item))
            return [
                _packb(
                    {
                        **head,
                        **meta,
                        "idx": uniq[j : j + per].astype("<i8").tobytes(),
                        "val": v[j : j + per].tobytes(),
                    }
                )
                for j in range(0, len(uniq), per)
            ]

        return [pack]

    def value(self) -> Any:
        return {
            "dtype": self._a.dtype.str,
            "shape": list(self._a.shape),
            "data": memoryview(self._flat.view(self._np.uint8)),
        }

    def _load(self, value: Any) -> None:
        np = self._np
        if (
            value.get("dtype") != self._a.dtype.str
            or tuple(value.get("shape", ())) != self._a.shape
        ):
            raise StateError(
                f"array {self.name!r}: the restored value is {value.get('dtype')}"
                f"{tuple(value.get('shape', ()))}, "
                f"the declaration {self._a.dtype.str}{self._a.shape}"
            )
        self._flat[:] = np.frombuffer(value["data"], dtype=self._a.dtype)
        self._all, self._chunks, self._count = False, [], 0

    def _apply(self, record: dict[str, Any]) -> None:
        np = self._np
        op = record.get("o")
        if op not in ("sparse", "slice"):
            return super()._apply(record)
        if record["dtype"] != self._a.dtype.str or tuple(record["shape"]) != self._a.shape:
            raise StateError(
                f"array {self.name!r}: a {op} record of {record['dtype']}{tuple(record['shape'])} "
                f"does not fit {self._a.dtype.str}{self._a.shape}"
            )
        vals = np.frombuffer(record["val"], dtype=self._a.dtype)
        if op == "sparse":
            self._flat[np.frombuffer(record["idx"], dtype="<i8")] = vals
        else:
            start = int(record["start"])
            self._flat[start : start + len(vals)] = vals
        return None


def _array_full(
    head: dict[str, Any], meta: dict[str, Any], data: bytes, item: int
) -> list[dict[str, Any]]:
    if len(data) <= codec.MAX_RECORD_BYTES:
        return [{**head, **meta, "data": data}]
    step = codec.MAX_RECORD_BYTES // item * item
    view = memoryview(data)
    return [
        {**head, **meta, "o": "slice", "start": off // item, "val": bytes(view[off : off + step])}
        for off in range(0, len(data), step)
    ]


# ------------------------------------------------------------------------------- vectors
class VectorIndex(Container):
    """Vectors by id (an embedding index); a checkpoint sends the rows upserted and the ids
    removed since the last one. ``search`` is brute-force cosine similarity."""

    kind = "vectors"

    def __init__(
        self, lock: threading.RLock, name: str, tier: str, dim: int, dtype: Any = "float32"
    ) -> None:
        super().__init__(lock, name, tier)
        np = _numpy()
        self._np = np
        self.dim = int(dim)
        self._dt = np.dtype(dtype)
        if self.dim <= 0 or self._dt.kind != "f":
            raise ValueError(f"vectors {name!r}: dim > 0 and a float dtype, got {dim} {self._dt}")
        self._m = np.zeros((16, self.dim), dtype=self._dt)
        self._ids: list[str] = []
        self._row: dict[str, int] = {}
        self._up: set[str] = set()
        self._rm: set[str] = set()
        self._all = False

    def _params(self) -> tuple[Any, ...]:
        return (self.dim, self._dt)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, vid: object) -> bool:
        return vid in self._row

    def ids(self) -> list[str]:
        return list(self._ids)

    def get(self, vid: str) -> np.ndarray:
        """A copy of vector ``vid`` (``KeyError`` if absent)."""
        with self._lock:
            out: np.ndarray = self._m[self._row[vid]].copy()
        return out

    def upsert(self, ids: Sequence[str], vectors: Any) -> None:
        """Insert or replace the vectors of ``ids`` (``vectors``: ``len(ids) x dim``)."""
        ids = [str(i) for i in ids]
        vecs = self._np.asarray(vectors, dtype=self._dt).reshape(len(ids), self.dim)
        with self._lock:
            self._upsert(ids, vecs)
            self._up.update(ids)
            self._rm.difference_update(ids)

    def remove(self, ids: Iterable[str]) -> None:
        """Remove these ids (absent ones are ignored)."""
        with self._lock:
            for vid in ids:
                if self._remove(str(vid)):
                    self._rm.add(str(vid))
                    self._up.discard(str(vid))

    def _upsert(self, ids: list[str], vecs: Any) -> None:
        rows = []
        for vid in ids:
            r = self._row.get(vid)
            if r is None:
                r = len(self._ids)
                self._row[vid] = r
                self._ids.append(vid)
            rows.append(r)
        if len(self._ids) > len(self._m):
            grown = self._np.zeros((max(len(self._ids), 2 * len(self._m)), self.dim), self._dt)
            grown[: len(self._m)] = self._m
            self._m = grown
        self._m[rows] = vecs

    def _remove(self, vid: str) -> bool:
        r = self._row.pop(vid, None)
        if r is None:
            return False
        last = len(self._ids) - 1
        if r != last:
            moved = self._ids[last]
            self._m[r] = self._m[last]
            self._ids[r] = moved
            self._row[moved] = r
        self._ids.pop()
        return True

    def search(self, query: Any, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` ids most similar to ``query`` (cosine), best first, with their scores."""
        np = self._np
        q = np.asarray(query, dtype=np.float32).reshape(self.dim)
        with self._lock:
            n = len(self._ids)
            if n == 0 or k <= 0:
                return []
            m = self._m[:n]
            scores = (m @ q) / (np.linalg.norm(m, axis=1) * (np.linalg.norm(q) or 1.0) + 1e-12)
            k = min(k, n)
            top = np.argpartition(-scores, k - 1)[:k]
            top = top[np.argsort(-scores[top])]
            return [(self._ids[int(i)], float(scores[int(i)])) for i in top]

    def _capture(self) -> list[Thunk]:
        n = len(self._ids)
        meta = {"dim": self.dim, "dtype": self._dt.str}
        row = self.dim * self._dt.itemsize
        per = max(1, codec.MAX_RECORD_BYTES // row)
        if self._all or len(self._up) > _FULL_FRACTION * max(n, 1):
            ids_all = list(self._ids)
            data = self._m[:n].tobytes()
            self._all, self._up, self._rm = False, set(), set()
            head = self._head("full")

            def pack_full() -> list[bytes]:
                view = memoryview(data)
                return [
                    _packb(
                        {
                            **head,
                            "o": "full" if j == 0 else "upsert",
                            **meta,
                            "ids": ids_all[j : j + per],
                            "vec": bytes(view[j * row : (j + per) * row]),
                        }
                    )
                    for j in range(0, max(n, 1), per)
                ]

            return [pack_full]
        out: list[Thunk] = []
        if self._rm:
            out.append(_packed_thunk({**self._head("remove"), "ids": sorted(self._rm)}))
            self._rm = set()
        if self._up:
            up = list(self._up)
            data = self._m[[self._row[i] for i in up]].tobytes()
            self._up = set()
            head = self._head("upsert")

            def pack() -> list[bytes]:
                view = memoryview(data)
                return [
                    _packb(
                        {
                            **head,
                            **meta,
                            "ids": up[j : j + per],
                            "vec": bytes(view[j * row : (j + per) * row]),
                        }
                    )
                    for j in range(0, len(up), per)
                ]

            out.append(pack)
        return out

    def value(self) -> Any:
        n = len(self._ids)
        return {
            "dim": self.dim,
            "dtype": self._dt.str,
            "rows": {vid: self._m[r].tobytes() for vid, r in zip(self._ids, range(n), strict=True)},
        }

    def _load(self, value: Any) -> None:
        np = self._np
        if (
            int(value.get("dim", self.dim)) != self.dim
            or value.get("dtype", self._dt.str) != self._dt.str
        ):
            raise StateError(
                f"vectors {self.name!r}: the restored index is {value.get('dim')}x"
                f"{value.get('dtype')}, the declaration {self.dim}x{self._dt.str}"
            )
        rows = value.get("rows") or {}
        self._ids = list(rows)
        self._row = {vid: i for i, vid in enumerate(self._ids)}
        m = np.frombuffer(b"".join(rows.values()), dtype=self._dt).reshape(-1, self.dim)
        # headroom (1/8): the first upserts after a restore must not copy the whole matrix
        self._m = np.zeros((max(16, len(self._ids) + len(self._ids) // 8), self.dim), self._dt)
        self._m[: len(m)] = m
        self._up, self._rm, self._all = set(), set(), False

    def _apply(self, record: dict[str, Any]) -> None:
        op = record.get("o")
        if op == "upsert":
            ids = [str(i) for i in record["ids"]]
            vecs = self._np.frombuffer(record["vec"], dtype=record["dtype"]).reshape(
                len(ids), self.dim
            )
            self._upsert(ids, vecs)
        elif op == "remove":
            for vid in record["ids"]:
                self._remove(str(vid))
        else:
            super()._apply(record)


# ---------------------------------------------------------------------------------- blob
class Blob(Container):
    """Opaque bytes (base config, base weights): sent whole, at the next checkpoint after
    :meth:`set`, content-addressed by BLAKE3 (cold by default: the object store)."""

    kind = "blob"

    def __init__(self, lock: threading.RLock, name: str, tier: str) -> None:
        super().__init__(lock, name, tier)
        self._data: bytes | None = None
        self._hash: str | None = None
        self._ref: dict[str, Any] | None = None
        self._partial: Any = None
        self._dirty = False

    def set(self, data: bytes) -> str:
        """Replace the value; returns its BLAKE3 hash."""
        data = bytes(data)
        digest = blake3.blake3(data).hexdigest()
        with self._lock:
            self._data, self._hash, self._ref, self._dirty = data, digest, None, True
        return digest

    def get(self) -> bytes | None:
        """The value (``None`` if never set)."""
        if self._ref is not None:
            raise StateError(
                f"blob {self.name!r}: its value ({self._ref['ref']}) is in the object store "
                "and was not sent with the restore"
            )
        return self._data

    @property
    def hash(self) -> str | None:
        return self._hash if self._ref is None else str(self._ref["ref"])

    def _capture(self) -> list[Thunk]:
        if not self._dirty or self._data is None:
            return []
        self._dirty = False
        value = {"data": self._data, "hash": self._hash}
        name, kind, tier = self.name, self.kind, self.tier
        limit = codec.MAX_RECORD_BYTES
        return [
            lambda: [
                _packb(r) for r in codec.full_records(name, kind, tier, value, max_bytes=limit)
            ]
        ]

    def value(self) -> Any:
        if self._ref is not None:
            return dict(self._ref)
        if self._data is None:
            return None
        return {"data": self._data, "hash": self._hash}

    def _load(self, value: Any) -> None:
        self._dirty = False
        if value is None:
            self._data = self._hash = self._ref = None
        elif "ref" in value:
            self._ref, self._data, self._hash = dict(value), None, None
        elif "data" in value:
            self._data, self._hash, self._ref = bytes(value["data"]), str(value["hash"]), None
        # an incomplete multi-part value: keep the old one until its last part

    def _apply(self, record: dict[str, Any]) -> None:
        if record.get("o") == "part":
            self._partial = codec.apply(self._partial, record)
            if "data" in self._partial:
                self._load(self._partial)
                self._partial = None
            return
        super()._apply(record)
