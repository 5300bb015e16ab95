"""Batched signature checks (each chain's newest signature every N events, the bytes before it
bound by their ``prev`` hashes) refuse exactly what checking every signature refuses.

``dsec audit verify`` (and the backbone bench's consumer) check one signature per chain head;
this compares its report with the per-event check's on seeded logs with forged, unauthorized,
reordered and replayed messages mixed in.
"""

from __future__ import annotations

import os
import random

import pytest
from dsec_core import canonical
from dsec_core.audit import Verifier, VerifyReport, verify_stream
from dsec_core.events import SandboxExited, SandboxStopRequested, SpecSubmitted
from dsec_core.signing import Signer
from dsec_testing.trust import Producer, certified
from nacl.signing import SigningKey

pytestmark = pytest.mark.unit

ROOT = SigningKey.generate()
ANCHOR = bytes(ROOT.verify_key)


def _forge(wire: bytes, rng: random.Random) -> bytes:
    """The same envelope with one signed field changed and the signature kept (or a random
    signature): what an attacker without the key can write."""
    fields = canonical.unpack(wire)
    if rng.random() < 0.5:
        fields["payload"] = {**fields["payload"], "duration_s": 999.0}
    else:
        fields["sig"] = rng.randbytes(64).hex()
    return canonical.canonical_bytes(fields)


def _log(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    agent = certified(ROOT, "nodeagent", node_id="n1")
    user = certified(ROOT, "user", tenant="default")
    other = certified(ROOT, "user", tenant="team-b")
    producers: list[Producer] = [agent, user, other]
    wires = [p.registration() for p in producers]
    stranger = Signer("nodeagent", SigningKey.generate())  # no certificate
    for i in range(rng.randint(20, 60)):
        sandbox = f"sbx_{i % 5}"
        roll = rng.random()
        if roll < 0.55:
            exited = SandboxExited(exit_code=0, reason="ok", duration_s=float(i))
            wires.append(agent.signer.seal(exited, aggregate_id=sandbox).wire)
        elif roll < 0.7:
            stop = SandboxStopRequested(requested_by="alice")
            wires.append(user.signer.seal(stop, aggregate_id=sandbox).wire)
        elif roll < 0.75:  # unauthorized: a user may not report a sandbox's exit
            exited = SandboxExited(exit_code=1, reason="ok", duration_s=1.0)
            wires.append(user.signer.seal(exited, aggregate_id=sandbox).wire)
        elif roll < 0.8:  # another tenant's user speaking for tenant default's sandbox
            submitted = SpecSubmitted(spec_yaml="x")
            wires.append(other.signer.seal(submitted, aggregate_id=sandbox).wire)
        elif roll < 0.85:  # an uncertified key
            stop = SandboxStopRequested()
            wires.append(stranger.seal(stop, aggregate_id=sandbox).wire)
        elif roll < 0.92 and len(wires) > 4:  # forged: an authentic message altered
            at = rng.randrange(3, len(wires))
            wires.append(_forge(wires[at], rng))
        elif len(wires) > 4:  # replayed: a copy of an earlier message
            wires.append(wires[rng.randrange(3, len(wires))])
    if rng.random() < 0.5 and len(wires) > 6:  # reordered: two neighbours swapped
        at = rng.randrange(3, len(wires) - 1)
        wires[at], wires[at + 1] = wires[at + 1], wires[at]
    if rng.random() < 0.3:  # an authentic message altered in place (tampering)
        at = rng.randrange(3, len(wires))
        wires[at] = _forge(wires[at], rng)
    return wires


def _outcome(report: VerifyReport) -> tuple[object, ...]:
    finding = report.finding
    return (
        None if finding is None else (finding.stream_seq, finding.reason),
        [(i.stream_seq, i.reason) for i in report.injected],
        report.events,
    )


@pytest.mark.parametrize("every", [3, 256])
@pytest.mark.parametrize("seed", range(12))
def test_batched_signature_checks_refuse_what_per_event_checks_refuse(
    seed: int, every: int
) -> None:
    wires = _log(seed)
    numbered = list(enumerate(wires, start=1))
    per_event = verify_stream(numbered, ANCHOR, signature_every=1)
    batched = verify_stream(numbered, ANCHOR, signature_every=every)
    assert _outcome(batched) == _outcome(per_event)
    assert per_event.injected or per_event.finding is not None  # the log holds attacks


def test_the_seeded_logs_cover_each_kind_of_attack() -> None:
    reasons = set()
    for seed in range(12):
        report = verify_stream(list(enumerate(_log(seed), start=1)), ANCHOR, signature_every=1)
        reasons |= {i.reason.split(":")[0] for i in report.injected}
        if report.finding is not None:
            reasons.add("finding")
    assert {"bad-signature", "unauthorized", "unknown-key", "replayed"} <= reasons, reasons
    assert "finding" in reasons, reasons


def test_the_unrolled_field_check_is_the_required_table() -> None:
    """The verifier's hot path checks the envelope's field types in one unrolled expression;
    it must refuse exactly what the table (and its error messages) refuse."""
    from dsec_core.audit import _REQUIRED, _fields
    from dsec_core.envelope import MalformedEnvelope

    agent = certified(ROOT, "nodeagent", node_id="n1")
    good = canonical.unpack(agent.registration())
    assert _fields(canonical.canonical_bytes(good)) == good
    wrong = {str: 1, int: "1", dict: [], (str, type(None)): 1}
    for name, kind in _REQUIRED.items():
        missing = {k: v for k, v in good.items() if k != name}
        for bad in (missing, {**good, name: wrong[kind]}):  # (a missing prev too: not nil)
            with pytest.raises(MalformedEnvelope, match=f"invalid envelope field {name}$"):
                _fields(canonical.canonical_bytes(bad))


def _full(report: VerifyReport) -> tuple[object, ...]:
    return (
        *_outcome(report),
        report.producers,
        report.chains,
        report.first_seq,
        report.last_seq,
        report.finding,
        report.injected,
    )


@pytest.mark.parametrize("seed", range(12))
async def test_the_verifier_process_reports_what_the_in_process_verifier_reports(
    seed: int,
) -> None:
    """``dsec audit verify`` verifies a long log in a forked process fed batches while it reads:
    the same report (finding, injected messages and their answers, counts) as in process."""
    from dsec_core.audit_worker import VerifierWorker

    wires = _log(seed)
    numbered = list(enumerate(wires, start=1))
    expected = verify_stream(numbered, ANCHOR)
    worker = VerifierWorker(ANCHOR)
    rng = random.Random(seed)
    try:
        at = 0
        while at < len(numbered):
            size = rng.randint(1, 9)
            stop = await worker.feed(numbered[at : at + size])
            at += size
            if stop:
                break
        report = await worker.finish()
    finally:
        worker.close()
    assert _full(report) == _full(expected)
    if expected.finding is not None and at < len(numbered):  # it said stop early
        assert expected.finding.stream_seq <= at


async def test_short_logs_stay_in_process_and_an_empty_log_verifies() -> None:
    from dsec_core import audit_worker

    inline = audit_worker.open_verifier(ANCHOR, audit_worker.WORKER_MIN_EVENTS - 1)
    assert isinstance(inline, audit_worker.InlineVerifier)
    worker = audit_worker.open_verifier(ANCHOR, audit_worker.WORKER_MIN_EVENTS)
    try:
        assert isinstance(worker, audit_worker.VerifierWorker)
        report = await worker.finish()  # nothing fed
    finally:
        worker.close()
    assert report.ok and report.events == 0 and report.first_seq is None


class _Broken(Verifier):
    def feed(self, *args: object) -> None:  # type: ignore[override]
        raise ValueError("out of memory, say")


async def test_a_failing_verifier_process_is_an_error_not_a_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dsec_core import audit, audit_worker

    # (the child imports the verifier from dsec_core.audit after the fork: it finds this one)
    monkeypatch.setattr(audit, "Verifier", _Broken)
    worker = audit_worker.VerifierWorker(ANCHOR)
    try:
        await worker.feed(list(enumerate(_log(0), start=1)))
        with pytest.raises(audit_worker.VerifierFailed, match="ValueError: out of memory, say"):
            await worker.finish()
    finally:
        worker.close()


def test_a_verifier_process_closed_before_it_was_fed_leaves_nothing_behind() -> None:
    """The command failed before it read anything (NATS unreachable: exit 3): the forked
    verifier is stopped and reaped, its pipes closed."""
    from dsec_core import audit_worker

    worker = audit_worker.VerifierWorker(ANCHOR)
    pid = worker._pid
    assert pid is not None
    worker.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped already: no such child
    assert worker._data_fd is None and worker._result_fd is None
