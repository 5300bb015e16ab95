"""The wire contract, checked by a verifier that shares no code with DSec.

``tests/wire_verifier/verify.mjs`` is written from ``docs/events.md`` and the AsyncAPI document
alone: Node.js built-ins (``node:crypto`` for Ed25519), MessagePack and BLAKE3 written from their
specifications. Here it reads the raw messages of a real JetStream stream that DSec's producers
filled, and must accept every genuine one and name each forgery; and docs/events.md must hold
exactly the bytes ``scripts/events_example.py`` generates with DSec's own signing code.

Node.js is required (``scripts/setup-system.sh`` installs it): without it these tests fail.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import blake3
import nats
import pytest
from dsec_core import canonical, identity
from dsec_core.audit import verify_stream
from dsec_core.bus import ensure_stream
from dsec_core.envelope import Envelope
from dsec_core.events import KeyRevoked, SandboxStopRequested, SpecRejected, SpecSubmitted
from dsec_core.schema import asyncapi_document
from dsec_core.subjects import STREAM
from dsec_core.trust import Gate, KeyRing, Refusal
from dsec_testing import trust
from dsec_testing.stack import StackFixture
from jsonschema import Draft202012Validator
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

ROOT = Path(__file__).resolve().parents[1]
VERIFIER = ROOT / "tests/wire_verifier/verify.mjs"
SIGNER = ROOT / "tests/wire_verifier/sign.mjs"
DOC = ROOT / "docs/events.md"

SPEC = """\
version: "1.2"
name: wire
base: dsec/python311:latest
entrypoint: [python, -c, "pass"]
resources: {cpu: 2, memory: 1GiB}
"""


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail(
            "Node.js is not installed: the wire-contract verifier (tests/wire_verifier) needs "
            "`node` (Debian package nodejs; scripts/setup-system.sh installs it)",
            pytrace=False,
        )
    return node


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "events_example", ROOT / "scripts/events_example.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _verify(tmp_path: Path, anchor: str, messages: list[dict[str, Any]]) -> dict[int, dict]:
    """Run the foreign verifier; its verdict per stream sequence."""
    schema = tmp_path / f"asyncapi-{uuid.uuid4().hex[:6]}.json"
    schema.write_text(json.dumps(asyncapi_document()))
    dump = tmp_path / f"messages-{uuid.uuid4().hex[:6]}.jsonl"
    dump.write_text("".join(json.dumps(m) + "\n" for m in messages))
    args = ["--anchor", anchor, "--asyncapi", str(schema), "--messages", str(dump)]
    done = subprocess.run(
        [_node(), str(VERIFIER), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    verdicts = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert [v["seq"] for v in verdicts] == [m["seq"] for m in messages], done.stdout
    return {v["seq"]: v for v in verdicts}


def _schema_errors(document: dict[str, Any], message: dict[str, Any]) -> list[str]:
    """What the AsyncAPI document's message schema (envelope + payload) and header schema say
    about one stored message (JSON Schema 2020-12, as pydantic writes the payload schemas)."""
    envelope = canonical.unpack(bytes.fromhex(message["data"]))
    components = document["components"]
    errors = []
    for ref, instance in (
        (f"#/components/messages/{envelope.get('type')}/payload", envelope),
        ("#/components/schemas/NatsHeaders", message["headers"]),
    ):
        validator = Draft202012Validator({"$ref": ref, "components": components})
        errors += [
            f"{ref} {list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(instance)
        ]
    return errors


def _message(seq: int, subject: str, data: bytes, msg_id: str | None) -> dict[str, Any]:
    headers = {"Nats-Msg-Id": msg_id} if msg_id is not None else {}
    return {"seq": seq, "subject": subject, "headers": headers, "data": data.hex()}


# --- the worked example of docs/events.md -------------------------------------------------------


def _block(text: str, name: str) -> str:
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    assert begin in text and end in text, f"{DOC} lost its {name} markers"
    return text.split(begin, 1)[1].split(end, 1)[0]


@pytest.mark.unit
def test_docs_events_md_holds_the_generated_example_and_event_table() -> None:
    text, example = DOC.read_text(), _example()
    assert _block(text, "example") == example.markdown(), (
        "docs/events.md's worked example is stale: paste the output of "
        "`uv run python scripts/events_example.py` between its markers"
    )
    assert _block(text, "catalog") == example.catalog(), (
        "docs/events.md's event table is stale: paste the output of "
        "`uv run python scripts/events_example.py --catalog` between its markers"
    )


@pytest.mark.unit
def test_the_foreign_verifier_accepts_the_example_and_names_each_alteration(
    tmp_path: Path,
) -> None:
    example = _example()
    anchor = example.anchor()
    reg, stop = (json.loads(line) for line in example.jsonl().splitlines())
    wire = bytes.fromhex(stop["data"])

    verdicts = _verify(tmp_path, anchor, [reg, stop])
    assert [v["verdict"] for v in verdicts.values()] == ["ok", "ok"], verdicts
    document = asyncapi_document()
    assert _schema_errors(document, reg) == [] and _schema_errors(document, stop) == []

    # one byte of the payload changed ("alice" -> "alicf"): the signature no longer holds
    tampered = wire.replace(b"alice", b"alicf", 1)
    assert tampered != wire
    cases = {
        "bad-signature": [reg, {**stop, "data": tampered.hex()}],
        "unknown-key": [{**stop, "seq": 1}],  # its key was never registered
        "broken-chain": [reg, stop, {**stop, "seq": 3, "headers": {}}],  # a copy of position 1
        "bad-msg-id": [reg, {**stop, "headers": {"Nats-Msg-Id": "another"}}],
        "misrouted": [reg, {**stop, "subject": "dsec.sandbox.sbx_other.stop_requested"}],
        "malformed": [reg, {**stop, "data": wire[:-1].hex()}],
    }
    for verdict, messages in cases.items():
        last = list(_verify(tmp_path, anchor, messages).values())[-1]
        assert last["verdict"] == verdict, (verdict, last)
    # a certificate from another root: the registration is not trusted, nor what the key signs
    other = _verify(tmp_path, "11" * 32, [reg, stop])
    assert [v["verdict"] for v in other.values()] == ["uncertified-key", "unknown-key"]


@pytest.mark.unit
def test_the_message_schemas_hold_the_whole_envelope() -> None:
    """The document's message schema is not vacuous: an envelope missing a field, with one
    more, with another type's payload, or without its Nats-Msg-Id header does not validate."""
    document = asyncapi_document()
    _, stop = (json.loads(line) for line in _example().jsonl().splitlines())
    fields = canonical.unpack(bytes.fromhex(stop["data"]))

    def errors(changed: dict[str, Any], headers: dict[str, str] | None = None) -> list[str]:
        data = canonical.canonical_bytes(changed).hex()
        return _schema_errors(
            document, {**stop, "data": data, "headers": headers or stop["headers"]}
        )

    assert errors(fields) == []
    assert errors({k: v for k, v in fields.items() if k != "chain"})
    assert errors({**fields, "extra": 1})
    assert errors({**fields, "payload": {**fields["payload"], "grace_s": "soon"}})
    assert errors({**fields, "payload": {"unknown": True}})
    assert errors({**fields, "subject": "dsec.sandbox.sbx_example.ready"})
    assert errors({**fields, "sig": "00"})
    assert errors(fields, {"Other": "x"})


@pytest.mark.unit
def test_the_verifiers_blake3_is_blake3(tmp_path: Path) -> None:
    """BLAKE3 is written by hand in the verifier (node:crypto has none): against the reference,
    around the block (64) and chunk (1024) boundaries and across tree levels."""
    lengths = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 2049, 3073, 4096, 8193, 70_000]
    script = tmp_path / "b3.mjs"
    script.write_text(
        f"import {{ blake3Hex }} from {json.dumps(str(VERIFIER.parent / 'blake3.mjs'))};\n"
        f"for (const n of {json.dumps(lengths)}) "
        "console.log(blake3Hex(Buffer.from(Array.from({length: n}, (_, i) => i % 251))));\n"
    )
    done = subprocess.run(
        [_node(), str(script)], capture_output=True, text=True, timeout=60, check=True
    )
    expected = [blake3.blake3(bytes(i % 251 for i in range(n))).hexdigest() for n in lengths]
    assert done.stdout.split() == expected


# --- a real stream --------------------------------------------------------------------------------


@pytest.fixture
def private_stack(tmp_path: Path) -> Iterator[StackFixture]:
    """A NATS server of this test's own: the stream holds only what the test publishes."""
    fixture = StackFixture(tmp_path / "home")
    try:
        yield fixture
    finally:
        fixture.close()


@pytest.fixture
async def bus(private_stack: StackFixture) -> AsyncIterator[tuple[NATS, JetStreamContext]]:
    nc = await nats.connect(private_stack.nats_url)
    js = nc.jetstream()
    await ensure_stream(js)
    yield nc, js
    await nc.close()


async def _raw_publish(js: JetStreamContext, subject: str, wire: bytes) -> int:
    ack = await js.publish(subject, wire, headers={"Nats-Msg-Id": uuid.uuid4().hex})
    return ack.seq


async def _dump(js: JetStreamContext) -> list[dict[str, Any]]:
    """Every stored message, as `nats stream get` shows it: subject, headers, bytes."""
    last = (await js.stream_info(STREAM)).state.last_seq
    out = []
    for seq in range(1, last + 1):
        try:
            msg = await js.get_msg(STREAM, seq)
        except NotFoundError:
            continue
        assert msg.subject is not None and msg.data is not None
        msg_id = (msg.headers or {}).get("Nats-Msg-Id")
        out.append(_message(seq, msg.subject, msg.data, msg_id))
    return out


@pytest.mark.integration
async def test_the_foreign_verifier_accepts_a_real_stream_and_names_each_forgery(
    bus: tuple[NATS, JetStreamContext], private_stack: StackFixture, tmp_path: Path
) -> None:
    nc, js = bus
    home = private_stack.home
    anchor = bytes(trust.stack_root(home).verify_key).hex()
    pipe = await trust.pipeline(js, home)  # five certified producers, their keys registered
    sid = f"sbx_wire_{uuid.uuid4().hex[:8]}"
    await pipe.built(SPEC, sid)  # spec.submitted, spec.validated, deps.resolved, env.built
    stop = await pipe.user.publish(
        SandboxStopRequested(requested_by="wire", grace_s=2.5), aggregate_id=sid
    )

    # 1. tampered: the stop request with another grace period, its signature kept
    fields = canonical.unpack(stop.sealed.wire)
    fields["payload"]["grace_s"] = 0.0
    tampered = await _raw_publish(js, stop.sealed.subject, canonical.canonical_bytes(fields))
    # 2. a key the root certified but that never registered in the log
    stranger = trust.certified(trust.stack_root(home), "user", subject="user-stranger")
    sealed = stranger.signer.seal(SandboxStopRequested(requested_by="x"), aggregate_id=sid)
    unregistered = await _raw_publish(js, sealed.subject, sealed.wire)
    # 3. a broken chain: the user's next position is signed but never published
    pipe.user.signer.seal(SandboxStopRequested(requested_by="lost"), aggregate_id=sid)
    after_gap = await pipe.user.publish(SandboxStopRequested(requested_by="on"), aggregate_id=sid)
    # 4. a key the operator revoked (below): what it signed before counts, after it does not
    operator = await trust.publisher(js, home, "operator", subject="operator")
    victim = await trust.publisher(js, home, "user", subject="user-victim")
    await victim.publish(SandboxStopRequested(requested_by="before"), aggregate_id=sid)
    # 5. an authentic event its role may not publish: refused, yet it holds its chain position
    unauthorized = await victim.publish(
        SpecRejected(errors=[{"msg": "a user cannot reject"}]), aggregate_id=sid
    )
    await victim.publish(SandboxStopRequested(requested_by="next"), aggregate_id=sid)
    key_id = victim.signer.key_id
    revocation = KeyRevoked(key_id=key_id, producer=victim.signer.producer, reason="test")
    await operator.publish(revocation, aggregate_id=key_id)
    revoked = await victim.publish(SandboxStopRequested(requested_by="after"), aggregate_id=sid)

    messages = await _dump(js)
    verdicts = _verify(tmp_path, anchor, messages)
    refused = {seq: v["verdict"] for seq, v in verdicts.items() if v["verdict"] != "ok"}
    assert refused == {
        tampered: "bad-signature",
        unregistered: "unknown-key",
        after_gap.stream_seq: "broken-chain",
        revoked.stream_seq: "revoked-key",
        unauthorized.stream_seq: "unauthorized",
    }, [v for v in verdicts.values() if v["verdict"] != "ok"]
    accepted = [v for v in verdicts.values() if v["verdict"] == "ok"]
    producers = {pipe.user.signer.producer, "policy", "builder", "nodeagent", "scheduler"}
    assert {v["producer"] for v in accepted} == {*producers, "operator", "user-victim"}
    kinds = {v["type"] for v in accepted}
    assert {"audit.key_registered", "audit.key_revoked", "spec.validated", "env.built"} <= kinds
    # 7 keys, 4 pipeline events, 3 stop requests, 1 revocation
    assert len(accepted) == len(messages) - len(refused) == 15
    document = asyncapi_document()
    for message in messages:  # each stored message is what the AsyncAPI document describes
        assert _schema_errors(document, message) == [], message["seq"]

    # DSec's own gate agrees on every message's signature and key (it checks no chain: the
    # event after the gap is authentic, the chain break is the log verifier's finding)
    gate = Gate(KeyRing(nc, js, bytes.fromhex(anchor)), js, None)
    for message in messages:
        seq = message["seq"]
        admitted = await gate.admit(bytes.fromhex(message["data"]), stream_seq=seq)
        if seq in refused and seq != after_gap.stream_seq:
            assert isinstance(admitted, Refusal) and admitted.reason == refused[seq], admitted
        else:
            assert isinstance(admitted, Envelope), (seq, admitted)
    # and `dsec audit verify`'s verifier lists exactly these messages as injected-and-ignored
    # (a user's broken chain is a misbehaving client, not tampering: the trail verifies)
    stored = [(m["seq"], bytes.fromhex(m["data"])) for m in messages]
    report = verify_stream(stored, bytes.fromhex(anchor))
    assert report.ok, report.finding
    assert {i.stream_seq for i in report.injected} == set(refused), report.injected


@pytest.mark.integration
async def test_events_signed_by_the_foreign_client_are_admitted_by_dsec(
    bus: tuple[NATS, JetStreamContext], private_stack: StackFixture, tmp_path: Path
) -> None:
    """The other half of the contract: a producer written from the doc (sign.mjs) signs and
    chains a user's events; published as they are, DSec's gate admits each one with its typed
    payload (a float the JSON input wrote as 5 included), and `audit verify`'s verifier finds
    an intact trail."""
    nc, js = bus
    root = trust.stack_root(private_stack.home)
    key, cert = identity.issue_user(root, "foreign", "default")
    credential = tmp_path / "foreign.json"
    credential.write_text(identity.credential_json(key, cert, bytes(root.verify_key)))
    schema = tmp_path / "asyncapi.json"
    schema.write_text(json.dumps(asyncapi_document()))
    sid = f"sbx_foreign_{uuid.uuid4().hex[:8]}"
    wanted = [
        {"type": "spec.submitted", "aggregate_id": sid, "payload": {"spec_yaml": SPEC}},
        {
            "type": "sandbox.stop_requested",
            "aggregate_id": sid,
            "payload": {"requested_by": "node", "grace_s": 5},
        },
    ]
    events_file = tmp_path / "events.json"
    events_file.write_text(json.dumps(wanted))
    args = ["--credential", str(credential), "--asyncapi", str(schema), "--events"]
    done = subprocess.run(
        [_node(), str(SIGNER), *args, str(events_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    produced = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(produced) == 3  # its key registration, then the two events

    gate = Gate(KeyRing(nc, js, bytes(root.verify_key)), js, None)
    admitted = []
    for message in produced:
        headers = message["headers"]
        ack = await js.publish(message["subject"], bytes.fromhex(message["data"]), headers=headers)
        verdict = await gate.admit(bytes.fromhex(message["data"]), stream_seq=ack.seq)
        assert isinstance(verdict, Envelope), verdict
        admitted.append(verdict)
    assert [e.type for e in admitted] == ["audit.key_registered", *(w["type"] for w in wanted)]
    assert [e.chain_seq for e in admitted] == [0, 1, 2]
    submitted, stop = admitted[1].decoded(), admitted[2].decoded()
    assert isinstance(submitted, SpecSubmitted) and submitted.spec_yaml == SPEC
    assert stop == SandboxStopRequested(requested_by="node", grace_s=5.0)
    raw = canonical.unpack(bytes.fromhex(produced[2]["data"]))
    assert isinstance(raw["payload"]["grace_s"], float)  # float 64, as the schema says
    assert admitted[1].tenant == "default" and admitted[1].producer == cert.subject

    stored = [(m["seq"], bytes.fromhex(m["data"])) for m in await _dump(js)]
    report = verify_stream(stored, bytes(root.verify_key))
    assert report.ok and report.injected == [] and report.events == 3, report
