"""The verifier's fast path (:meth:`dsec_core.audit.Verifier._fast`: the envelope decoded by
msgspec into a struct, the payload by MessagePack, authorization verdicts remembered) reports
exactly what the full path (every envelope decoded by MessagePack into a dict) reports.

Seeded logs mix authentic events of several roles with forged, unauthorized, replayed,
reordered and re-encoded ones (the same values written another way: a duplicate key, a
non-minimal header, an extra field, a bool for an int, bytes for a string, trailing bytes,
foreign types in the payload), and each is verified twice: as shipped, and with the fast path
turned off.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from dsec_core import audit, audit_report, canonical, signing
from dsec_core.audit import Verifier, VerifyReport, verify_stream
from dsec_core.events import (
    EnvBuilt,
    SandboxExited,
    SandboxScheduled,
    SandboxStopRequested,
    SpecSubmitted,
)
from dsec_core.signing import Signer
from dsec_testing.trust import Producer, certified
from nacl.signing import SigningKey

pytestmark = pytest.mark.unit

ROOT = SigningKey.generate()
ANCHOR = bytes(ROOT.verify_key)


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _map(items: list[tuple[Any, Any]], *, wide: bool = False) -> bytes:
    """A MessagePack map of ``items`` as given (duplicates, order and header kept)."""
    wide = wide or len(items) >= 16
    head = struct.pack(">BH", 0xDE, len(items)) if wide else bytes([0x80 | len(items)])
    return head + b"".join(_pack(k) + _pack(v) for k, v in items)


def _variant(wire: bytes, rng: random.Random) -> bytes:
    """The same envelope (its signature kept) written in one of the ways a forger or a
    broken client might: some decode to the same values, some do not decode, some to others."""
    try:
        fields = canonical.unpack(wire)
    except ValueError:  # a variant already (a replayed copy of one)
        return wire + b"\xc0"
    items = sorted(fields.items())
    how = rng.randrange(13)
    if how == 0:  # non-minimal map header: the same values
        return _map(items, wide=True)
    if how == 1:  # a duplicate key, the last one the real value
        return _map([("id", "decoy"), *items])
    if how == 2:  # a duplicate key, the last one another value
        return _map([*items, ("tenant", "team-b")])
    if how == 3:  # a field no producer writes
        return _map([*items, ("extra", 1)])
    if how == 4:  # a bool where an int goes
        return _map([(k, bool(v) if k == "chain_seq" else v) for k, v in items])
    if how == 5:  # bytes where a string goes
        return _map([(k, v.encode() if k == "id" and isinstance(v, str) else v) for k, v in items])
    if how == 6:  # trailing bytes
        return wire + b"\xc0"
    if how == 7 and isinstance(fields["payload"], dict):  # an int key in the payload (refused)
        inner = sorted(fields["payload"].items())
        payload = bytes([0x80 | (len(inner) + 1)]) + _map(inner)[1:] + _pack(7) + _pack("x")
        rest = [(k, v) for k, v in items if k != "payload"]
        return (
            struct.pack(">BH", 0xDE, len(items))
            + _map(rest, wide=True)[3:]
            + _pack("payload")
            + payload
        )
    if how == 8 and isinstance(fields["payload"], dict):  # a node id that is no string
        payload = {**fields["payload"], "node_id": rng.choice([1, True, ["n1"], None])}
        return _map([(k, payload if k == "payload" else v) for k, v in items])
    if how == 9:  # a causation id that is no string
        return _map([(k, 5 if k == "causation_id" else v) for k, v in items])
    if how == 10 and isinstance(fields["payload"], dict):  # an ext type in the payload
        payload = {**fields["payload"], "node_id": msgpack.ExtType(5, b"n1")}
        return _map([(k, payload if k == "payload" else v) for k, v in items])
    if how == 11:  # the payload shadowed: a first "payload" the strict decode refuses
        return _map([("payload", {1: 1}), *items])
    return _map([(k, v) for k, v in items if k != rng.choice(["aggregate", "time", "subject"])])


# Payload values the fast path's msgspec decode must refuse, or take as MessagePack does.
_ODD_VALUES: list[Any] = [
    {"a": {1: "x"}},  # a non-string key, nested
    {"a": [{"b": {2.5: 1}}]},
    {"a": [[[[[[["seven deep"]]]]]]]},  # deeper than the msgspec decode goes
    {"a": [[[[["five deep", {"k": None}]]]]]},
    {"a": b"\xff", "b": [b"x"]},  # bytes
    {"a": [1.5, True, 0, None, "s", {"d": -(2**63)}, 2**64 - 1]},
    {"a": msgpack.Timestamp(1, 0)},
    {"a": {b"k": 1}},  # a bytes key (the strict decode takes it)
    {"a": {"": {"": []}}},
    {"a": {"x": [{"y": {3: 4}}]}},
]


def _odd(
    p: Producer, wire: bytes, rng: random.Random, ids: list[str], how: int | None = None
) -> bytes:
    """``wire`` (just sealed by ``p``) with a field changed and signed again by ``p`` in the
    same chain position (the chain goes on from it): an authentic event of a broken or
    malicious producer, which the verifier must take or refuse the same way on both paths."""
    fields = canonical.unpack(wire)
    payload = fields["payload"]
    how = rng.randrange(11) if how is None else how
    if how == 0:
        fields["chain_seq"] = bool(fields["chain_seq"])
    elif how == 1:
        fields["id"] = fields["id"].encode()
    elif how == 2:
        payload["node_id"] = rng.choice([1, True, ["n1"], msgpack.ExtType(5, b"n1"), None])
    elif how == 3:
        payload["node_id"] = rng.choice(["n1", "n2"])
    elif how == 4:
        fields["causation_id"] = rng.choice([5, rng.choice(ids) if ids else None])
    elif how == 5:
        fields["extra"] = 1
    elif how == 6:
        del fields[rng.choice(["aggregate", "time", "subject", "correlation_id"])]
    elif how == 7 and ids:  # an event id it emitted before (it acted on a replay)
        fields["id"] = rng.choice(ids)
    elif how == 8:
        fields["payload"] = rng.choice([[], None, "x", 1])
    elif how == 9:  # values the payload's msgspec decode must refuse, or take as MessagePack does
        payload["more"] = rng.choice(_ODD_VALUES)
    else:
        fields["tenant"] = rng.choice(["default", "team-b", "system"])
    fields["sig"] = p.signer._key.sign(signing.signed_bytes(fields)).signature.hex()
    odd = _map(sorted(fields.items(), key=lambda kv: str(kv[0])), wide=rng.random() < 0.5)
    p.signer._prev = signing.envelope_hash(odd)
    return odd


def _log(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    agent = certified(ROOT, "nodeagent", node_id="n1")
    agent2 = certified(ROOT, "nodeagent", subject="nodeagent-2", node_id="n2")
    scheduler = certified(ROOT, "scheduler")
    builder = certified(ROOT, "builder")
    user = certified(ROOT, "user", tenant="default")
    other = certified(ROOT, "user", tenant="team-b")
    producers: list[Producer] = [agent, agent2, scheduler, builder, user, other]
    wires = [p.registration() for p in producers]
    authentic: list[bytes] = []
    ids: list[str] = []
    variant = False
    for i in range(rng.randint(60, 160)):
        if i and len(wires) > len(producers) and not variant:
            authentic.append(wires[-1])  # (a replayed copy counts too: it decodes)
        variant = False
        sandbox = f"sbx_{i % 6}"
        roll = rng.random()
        if roll < 0.35:
            node_agent = agent if rng.random() < 0.8 else agent2
            exited = SandboxExited(exit_code=0, reason="ok", duration_s=float(i))
            wires.append(node_agent.signer.seal(exited, aggregate_id=sandbox).wire)
            if rng.random() < 0.15:
                wires[-1] = _odd(node_agent, wires[-1], rng, ids)
            else:
                ids.append(canonical.unpack(wires[-1])["id"])
        elif roll < 0.45:
            stop = SandboxStopRequested(requested_by="alice")
            wires.append(user.signer.seal(stop, aggregate_id=sandbox).wire)
        elif roll < 0.5:
            submitted = SpecSubmitted(spec_yaml="x")
            signer = (user if rng.random() < 0.7 else other).signer
            wires.append(signer.seal(submitted, aggregate_id=sandbox).wire)
        elif roll < 0.55:
            placed = SandboxScheduled(node_id=rng.choice(["n1", "n2"]))
            wires.append(scheduler.signer.seal(placed, aggregate_id=sandbox).wire)
        elif roll < 0.6:
            built = EnvBuilt(
                lock_hash="l", fingerprint="f", object_key="k", digest="d", size_bytes=1, reused=1
            )
            wires.append(builder.signer.seal(built, aggregate_id=sandbox).wire)
        elif roll < 0.61:  # the agent's key under another producer's name (a new chain)
            impostor = Signer("scheduler", agent.signer._key)
            exited = SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
            wires.append(impostor.seal(exited, aggregate_id=sandbox).wire)
        elif roll < 0.63:  # a user speaking for another tenant
            stop = SandboxStopRequested(requested_by="mallory")
            wires.append(other.signer.seal(stop, aggregate_id=sandbox).wire)
        elif roll < 0.8 and authentic:  # an authentic event written another way
            wires.append(_variant(rng.choice(authentic), rng))
            variant = True
        elif roll < 0.85 and len(wires) > 7:  # replayed
            wires.append(wires[rng.randrange(6, len(wires))])
    if rng.random() < 0.4 and authentic:  # re-encoded in place: the chain after it breaks
        at = wires.index(rng.choice(authentic))
        wires[at] = _variant(wires[at], rng)
    return wires


_PATHS = ("c", "python", "full")


def _verify(
    numbered: list[tuple[int, bytes]],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    every: int = audit.SIGNATURE_EVERY,
) -> VerifyReport:
    """Verify with the common case taken by C (as shipped), by the Python fast path, or by
    neither (every event the full way)."""
    with _on_path(path, monkeypatch):
        return verify_stream(numbered, ANCHOR, signature_every=every)


@contextlib.contextmanager
def _on_path(path: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within it, the common case is taken by ``path``: "c", "python" or "full" (neither)."""
    assert audit._fast_run is not None, (
        "dsec-core's C extension (dsec_core._auditfast) is not built: `./taskw setup` needs a "
        "C compiler (gcc) and the interpreter's headers"
    )
    with monkeypatch.context() as patch:
        if path != "c":
            patch.setattr(audit, "_fast_run", None)
        if path == "full":
            patch.setattr(Verifier, "_fast", lambda *args: False)
        yield


def _each_path(
    numbered: list[tuple[int, bytes]], monkeypatch: pytest.MonkeyPatch, *, every: int = 256
) -> VerifyReport:
    """The report, the same whichever path takes the common case (asserted)."""
    c, python, full = (_verify(numbered, p, monkeypatch, every=every) for p in _PATHS)
    assert _full(c) == _full(full)
    assert _full(python) == _full(full)
    return c


def _full(report: VerifyReport) -> tuple[object, ...]:
    return (
        report.finding,
        report.injected,
        report.events,
        report.producers,
        report.chains,
        report.first_seq,
        report.last_seq,
    )


@pytest.mark.parametrize("every", [1, 4, 256])
@pytest.mark.parametrize("seed", range(24))
def test_the_fast_path_reports_what_the_full_path_reports(
    seed: int, every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _each_path(list(enumerate(_log(seed), start=1)), monkeypatch, every=every)


def _each_payload(key: str, values: list[Any], monkeypatch: pytest.MonkeyPatch) -> VerifyReport:
    """A node agent's events, the payload's ``key`` set to each of ``values`` (``None``: left
    as sealed) and signed again; verified on each path (the same report, asserted)."""
    agent = certified(ROOT, "nodeagent", node_id="n1")
    wires = [agent.registration()]
    for i, value in enumerate(values):
        exited = SandboxExited(exit_code=0, reason="ok", duration_s=float(i))
        wire = agent.signer.seal(exited, aggregate_id="sbx_1").wire
        if value is not None:
            fields = canonical.unpack(wire)
            fields["payload"][key] = value
            fields["sig"] = agent.signer._key.sign(signing.signed_bytes(fields)).signature.hex()
            wire = _map(sorted(fields.items()))
            agent.signer._prev = signing.envelope_hash(wire)
        wires.append(wire)
    return _each_path(list(enumerate(wires, start=1)), monkeypatch)


@pytest.mark.parametrize("node", [1, True, ["n1"], msgpack.ExtType(5, b"n1"), "n2"])
def test_a_payloads_odd_node_id_gets_the_same_verdict(
    node: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Authorization verdicts are remembered by the values they read: a node id that is no
    string (an equal 1 and True, an unhashable list) must not share or break them."""
    report = _each_payload("node_id", [None, node, 1, True, None, node], monkeypatch)
    assert report.injected  # refused: a node agent speaking for another node


@pytest.mark.parametrize("value", _ODD_VALUES)
def test_a_payloads_odd_values_get_the_same_verdict(
    value: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload the fast path's msgspec decode must refuse (a non-string key at any depth,
    bytes, ext types, deep nesting), or take as MessagePack's strict decode does."""
    _each_payload("more", [None, value, None, value, None], monkeypatch)


def test_an_injected_envelope_with_a_shadowed_payload_is_refused_on_both_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Anyone can publish: a copy of a producer's next chain position, its signature garbage,
    with a first ``payload`` MessagePack's strict decode refuses ({1: 1}) before the real one.
    msgspec keeps the last of two keys without reading the first; the fast path took it into
    the chain and the verifier failed at its signature check (no verdict at all). Both paths
    now list it as injected, and the producer's genuine next event still verifies."""
    agent = certified(ROOT, "nodeagent", node_id="n1")
    exited = [SandboxExited(exit_code=0, reason="ok", duration_s=float(i)) for i in range(5)]
    wires = [agent.registration()]
    wires += [agent.signer.seal(exited[i], aggregate_id="sbx_1").wire for i in range(3)]
    last = canonical.unpack(wires[-1])
    forged = {
        **last,
        "id": "forged",
        "chain_seq": last["chain_seq"] + 1,
        "prev": signing.envelope_hash(wires[-1]),
        "sig": "00" * 64,
    }
    wires.append(_map([("payload", {1: 1}), *sorted(forged.items())]))
    wires.append(agent.signer.seal(exited[4], aggregate_id="sbx_1").wire)
    report = _each_path(list(enumerate(wires, start=1)), monkeypatch)
    assert report.ok and [i.stream_seq for i in report.injected] == [5] and report.events == 5


def test_a_chain_opened_by_a_refused_event_counts_once_the_fast_path_takes_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The report's chain count includes chains whose events were all refused (a certified
    key under another producer's name), as of the next event taken, whichever path takes it."""
    agent = certified(ROOT, "nodeagent", node_id="n1")
    impostor = Signer("scheduler", agent.signer._key)
    exited = SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
    wires = [agent.registration()]
    wires += [agent.signer.seal(exited, aggregate_id="sbx_1").wire for _ in range(3)]
    wires.append(impostor.seal(exited, aggregate_id="sbx_1").wire)
    wires += [agent.signer.seal(exited, aggregate_id="sbx_1").wire for _ in range(3)]
    report = _each_path(list(enumerate(wires, start=1)), monkeypatch)
    assert report.chains == 2 and len(report.injected) == 1


def test_the_seeded_logs_hold_what_the_fast_path_must_leave_alone() -> None:
    reasons: set[str] = set()
    for seed in range(16):
        report = verify_stream(list(enumerate(_log(seed), start=1)), ANCHOR)
        reasons |= {i.reason.split(":")[0] for i in report.injected}
        if report.finding is not None:
            reasons.add("finding")
    assert {"malformed", "unauthorized", "replayed", "bad-signature", "finding"} <= reasons


@pytest.mark.parametrize("path", ["c", "python"])
def test_authentic_events_take_the_fast_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event of a plain log after the first of each chain (its registration, the first
    sight of its route) goes the fast way: the speed this file guards is real. With the C
    path, Python sees only those and the one event whose authorization verdict is asked first
    (the Python fast path asks and remembers it)."""
    agent = certified(ROOT, "nodeagent", node_id="n1")
    wires = [agent.registration()]
    for i in range(300):
        exited = SandboxExited(exit_code=0, reason="ok", duration_s=float(i))
        wires.append(agent.signer.seal(exited, aggregate_id=f"sbx_{i % 3}").wire)
    full: list[int] = []
    fed: list[int] = []
    check, feed = Verifier._check, Verifier.feed

    def counting_check(self: Verifier, seq: int, *args: Any) -> None:
        full.append(seq)
        check(self, seq, *args)

    def counting_feed(self: Verifier, seq: int, *args: Any) -> Any:
        fed.append(seq)
        return feed(self, seq, *args)

    monkeypatch.setattr(Verifier, "_check", counting_check)
    monkeypatch.setattr(Verifier, "feed", counting_feed)
    report = _verify(list(enumerate(wires, start=1)), path, monkeypatch)
    assert report.ok and report.events == 301
    assert full == [1, 2, 3, 4]  # the registration, the first of each sandbox's route
    if path == "c":
        assert fed == [1, 2, 3, 4, 5]  # and the first whose verdict is asked: the C took 296
    else:
        assert len(fed) == 301


def test_the_struct_names_every_field_a_signer_writes() -> None:
    """A field the signer writes that the struct does not know would send every event the
    full way (msgspec refuses unknown fields): the struct and the envelope agree."""
    agent = certified(ROOT, "nodeagent", node_id="n1")
    wire = agent.signer.seal(
        SandboxExited(exit_code=0, reason="ok", duration_s=1.0), aggregate_id="sbx_1"
    ).wire
    assert set(canonical.unpack(wire)) == set(audit._Envelope.__struct_fields__)


def _plain_log(events: int) -> list[bytes]:
    agent = certified(ROOT, "nodeagent", node_id="n1")
    scheduler = certified(ROOT, "scheduler")
    wires = [agent.registration(), scheduler.registration()]
    for i in range(events):
        if i % 5 == 0:
            placed = SandboxScheduled(node_id="n1")
            wires.append(scheduler.signer.seal(placed, aggregate_id=f"sbx_{i % 7}").wire)
        else:
            exited = SandboxExited(exit_code=0, reason="ok", duration_s=float(i))
            wires.append(agent.signer.seal(exited, aggregate_id=f"sbx_{i % 7}").wire)
    return wires


@pytest.mark.parametrize("every", [1, 256])
@pytest.mark.parametrize("seed", range(8))
def test_digests_given_by_the_reader_give_the_same_report(
    seed: int, every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dsec audit verify``'s reader hashes each envelope and sends (seq, data, digest): fed
    in batches of every size, each path reports what the full path reports unhashed."""
    numbered = list(enumerate(_log(seed), start=1))
    expected = _verify(numbered, "full", monkeypatch, every=every)
    hashed = [(seq, data, signing.envelope_hash(data)) for seq, data in numbered]
    for path in ("c", "python"):
        with _on_path(path, monkeypatch):
            for size in (1, 3, 50, len(hashed)):
                verifier = Verifier(ANCHOR, every)
                for at in range(0, len(hashed), size):
                    if verifier.feed_many(hashed[at : at + size]) is not None:
                        break
                assert _full(verifier.finish()) == _full(expected), (path, size)


@pytest.mark.parametrize("hole", ["gap", "repeat", "back"])
def test_a_sequence_out_of_order_mid_batch_is_the_same_finding(
    hole: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's sequence numbers, checked first for each event: a missing one, one seen
    twice, one going back: the C path leaves it to feed, which names it, on every path."""
    numbered = list(enumerate(_plain_log(40), start=1))
    at = 20
    seq, data = numbered[at]
    numbered[at] = ({"gap": seq + 1, "repeat": seq - 1, "back": 3}[hole], data)
    report = _each_path(numbered, monkeypatch)
    assert report.finding is not None and report.finding.stream_seq == numbered[at][0]
    assert report.finding.reason.startswith("gap")


def test_items_the_c_path_does_not_read_go_the_python_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch item of another shape or type (a bytearray, a list, a big or bool sequence
    number) is fed by Python as before, with the same outcome."""
    numbered = list(enumerate(_plain_log(12), start=1))
    bent: list[Any] = list(numbered)
    bent[5] = (6, bytearray(numbered[5][1]))
    bent[6] = [7, numbered[6][1]]
    expected = _full(_verify(numbered, "full", monkeypatch))
    for path in ("c", "python"):
        with _on_path(path, monkeypatch):
            verifier = Verifier(ANCHOR)
            verifier.feed_many(bent)
            assert _full(verifier.finish()) == expected
    for seq in (2**70, True):  # (True == 1: the next is 2 as always; after 2**70, a gap)
        report = _each_path([(seq, numbered[0][1]), *numbered[1:]], monkeypatch)
        assert (report.finding is not None) == (seq != 1)


def test_the_c_path_keeps_no_reference_to_what_it_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every object the C path reads or makes is released: the wires and digests it was given
    are referenced as before once the verifier is gone, and nothing it allocated stays."""
    hashed = [
        (seq, data, signing.envelope_hash(data))
        for seq, data in enumerate(_plain_log(600), start=1)
    ]
    before = [(sys.getrefcount(data), sys.getrefcount(digest)) for _, data, digest in hashed]
    _verify([(s, d) for s, d, _ in hashed], "c", monkeypatch)  # (warm: caches, interned names)
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(3):
            verifier = Verifier(ANCHOR)
            assert verifier.feed_many(hashed) is None
            report = verifier.finish()
            assert report.ok and report.events == len(hashed)
            del verifier, report
        gc.collect()
        left, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert left < 64 * 1024, f"{left} bytes still allocated after three verifications"
    after = [(sys.getrefcount(data), sys.getrefcount(digest)) for _, data, digest in hashed]
    assert after == before


def test_dsec_audit_pure_python_turns_the_c_path_off_and_a_bad_value_is_named() -> None:
    code = "import dsec_core.audit as a; print(a._fast_run is None)"
    env = {k: v for k, v in os.environ.items() if k != "DSEC_AUDIT_PURE_PYTHON"}
    for value, off in (("on", True), ("0", False)):  # (c_path_wanted: every spelling, below)
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "DSEC_AUDIT_PURE_PYTHON": value},
            capture_output=True,
            text=True,
            check=True,
        )
        assert done.stdout.strip() == str(off), value
    bad = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "DSEC_AUDIT_PURE_PYTHON": "maybe"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0
    assert "DSEC_AUDIT_PURE_PYTHON='maybe' is invalid: use 1/true/yes/on" in bad.stderr


# -- found by an adversarial review of the C path (2026-12-06), each failing on its first build --


def _one_route_log(events: int) -> list[bytes]:
    """A node agent's registration and ``events`` of one sandbox: from the fourth wire on
    (the route seen, the verdict remembered) the common case."""
    agent = certified(ROOT, "nodeagent", node_id="n1")
    exited = [SandboxExited(exit_code=0, reason="ok", duration_s=float(i)) for i in range(events)]
    return [
        agent.registration(),
        *(agent.signer.seal(e, aggregate_id="sbx_1").wire for e in exited),
    ]


def test_the_largest_sequence_number_is_left_to_python_and_gives_the_same_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2**63 - 1 taken in C made the next expected sequence overflow: a false gap after it, or
    a gap of 2**64 passed as in order. Such a sequence is now fed by Python."""
    wires = _one_route_log(5)
    base = 2**63 - 1 - 4  # (the fifth wire, a common event, at 2**63 - 1)
    for after in (2**63, -(2**63)):
        numbered = [(base + i, w) for i, w in enumerate(wires[:5])] + [(after, wires[5])]
        report = _each_path(numbered, monkeypatch)
        assert (report.finding is None) == (after == 2**63)


def test_a_batch_shrunk_by_code_the_c_path_calls_is_read_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``feed_many`` with the caller's own digests: a digest's truth test that empties the
    batch being walked crashed the C path (it kept the first length); it now reads the list
    as it is after each event, as the Python loop does."""
    wires = _one_route_log(20)
    verifier = Verifier(ANCHOR)
    verifier.feed_many(list(enumerate(wires[:6], start=1)))
    batch: list[Any] = []

    class Digest(str):
        def __bool__(self) -> bool:
            batch.clear()
            return True

    digest = Digest(signing.envelope_hash(wires[6]))
    batch += [(7, wires[6], digest), *enumerate(wires[7:], start=8)]
    verifier.feed_many(batch)
    assert verifier.report.ok and verifier.report.last_seq == 7 and batch == []


@pytest.mark.parametrize("every", [2**64, 4.0, 2.5])
def test_a_signature_period_the_c_path_cannot_hold_goes_the_python_way(
    every: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = _each_path(list(enumerate(_plain_log(8), start=1)), monkeypatch, every=every)
    assert report.ok and report.events == 10


def test_an_error_mid_batch_leaves_the_same_state_on_every_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception while an event is judged (here a certificate that raises; in life a
    KeyboardInterrupt in a decode) is raised after that event's prologue on every path, so a
    caller that goes on feeding sees the same stream position and the same gap."""
    wires = _one_route_log(8)

    class Boom(Exception):
        pass

    class Cert:
        armed = True

        def __init__(self, real: Any) -> None:
            self.real = real

        def __getattr__(self, name: str) -> Any:
            if name == "subject" and self.armed:
                raise Boom
            return getattr(self.real, name)

    seen = []
    for path in ("c", "python"):
        with _on_path(path, monkeypatch):
            verifier = Verifier(ANCHOR)
            verifier.feed_many(list(enumerate(wires[:5], start=1)))
            agent_key = next(k for k, c in verifier._certs.items() if c.role == "nodeagent")
            cert = Cert(verifier._certs[agent_key])
            verifier._certs[agent_key] = cert  # type: ignore[assignment]
            with pytest.raises(Boom):
                verifier.feed_many(list(enumerate(wires[5:], start=6)))
            report = verifier.report
            state = (verifier._expected, report.first_seq, report.last_seq, report.events)
            Cert.armed = False
            verifier.feed_many([(6, wires[5])])  # the caller retries the event that failed
            Cert.armed = True
            seen.append((state, report.finding))
    assert seen[0] == seen[1]
    assert seen[0][1] is not None and seen[0][1].reason.startswith("gap")


@pytest.mark.parametrize(
    ("value", "wanted"),
    [
        ("1", False),
        ("true", False),
        (" Yes ", False),
        ("on", False),
        ("", True),
        ("0", True),
        ("false", True),
        ("no", True),
        ("OFF", True),
    ],
)
def test_every_spelling_of_the_pure_python_setting(
    value: str, wanted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSEC_AUDIT_PURE_PYTHON", value)
    assert audit_report.c_path_wanted() is wanted
