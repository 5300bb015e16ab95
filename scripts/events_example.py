"""Print the worked example of docs/events.md: real bytes from DSec's own signing code.

Fixed keys (seeds below), a fixed clock and fixed ids make the output reproducible: Ed25519
signatures are deterministic (RFC 8032), so every byte printed here is what DSec produces for
these inputs. ``tests/test_wire_contract.py`` checks that docs/events.md holds exactly this
output and that the foreign verifier accepts it.

    uv run python scripts/events_example.py              # the Markdown section
    uv run python scripts/events_example.py --catalog    # the event table
    uv run python scripts/events_example.py --jsonl F    # also the two messages, as stored
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from unittest import mock

import blake3
from dsec_core import canonical
from dsec_core.events import KeyRegistered, SandboxStopRequested
from dsec_core.identity import Certificate
from dsec_core.signing import Sealed, Signer, key_id_of
from nacl.signing import SigningKey

ROOT_SEED = bytes(range(32))
USER_SEED = bytes(range(32, 64))
ISSUED_AT = datetime(2026, 1, 1, tzinfo=UTC)
TIMES = [
    datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
    datetime(2026, 1, 2, 3, 4, 6, tzinfo=UTC),
]
IDS = [
    "0194f0c2-0000-7000-8000-000000000001",  # the chain
    "0194f0c2-0000-7000-8000-000000000002",  # the key registration
    "0194f0c2-0000-7000-8000-000000000003",  # the stop request
]
SANDBOX = "sbx_example"


def certificate(root: SigningKey, public_raw: bytes) -> Certificate:
    """The root's certificate for the user key, as ``dsec_core.identity.issue`` builds it."""
    fields: dict[str, Any] = {
        "subject": "user-alice",
        "role": "user",
        "tenant": "default",
        "node_id": None,
        "public_key": public_raw.hex(),
        "key_id": key_id_of(public_raw),
        "issued_at": ISSUED_AT,
        "expires_at": None,
        "issuer": key_id_of(bytes(root.verify_key)),
        "sig": "",
    }
    unsigned = Certificate.model_validate(fields)
    return unsigned.model_copy(update={"sig": root.sign(unsigned.signed_bytes()).signature.hex()})


def seal_example() -> tuple[SigningKey, Certificate, list[Sealed]]:
    """The root key, the user's certificate and the user's first two envelopes."""
    root, user = SigningKey(ROOT_SEED), SigningKey(USER_SEED)
    cert = certificate(root, bytes(user.verify_key))
    ids, times = iter(IDS), iter(TIMES)
    with (
        mock.patch("dsec_core.signing.new_event_id", lambda: next(ids)),
        mock.patch("dsec_core.signing.utcnow", lambda: next(times)),
    ):
        signer = Signer("user-alice", user, tenant="default")
        reg = KeyRegistered(
            producer=signer.producer,
            key_id=signer.key_id,
            public_key=signer.public_raw.hex(),
            certificate=cert.model_dump(mode="json"),
        )
        first = signer.seal(reg, aggregate_id=signer.key_id, tenant="system")
        stop = SandboxStopRequested(requested_by="alice", grace_s=5.0)
        second = signer.seal(stop, aggregate_id=SANDBOX)
    return root, cert, [first, second]


def _wrap(text: str, width: int = 96) -> str:
    return "\n".join(text[i : i + width] for i in range(0, len(text), width))


def _fields_table(fields: dict[str, Any]) -> Iterator[str]:
    yield "| field | value | key + value, canonical MessagePack (hex) |"
    yield "|---|---|---|"
    for name, value in fields.items():
        if name == "payload":
            shown = "(the map below)"
        elif isinstance(value, str) and len(value) > 40:
            shown = f"`{value[:16]}…`"
        else:
            shown = f"`{json.dumps(value)}`"
        encoded = canonical.pack(name).hex() + " " + canonical.pack(value).hex()
        if len(encoded) > 60:
            encoded = encoded[:56] + "…"
        yield f"| {name} | {shown} | `{encoded}` |"


def markdown() -> str:
    """The worked-example section of docs/events.md."""
    root, cert, (first, second) = seal_example()
    root_pub = bytes(root.verify_key)
    user_pub = bytes.fromhex(cert.public_key)
    cert_dict = cert.model_dump(mode="json")
    cert_signed = cert.signed_bytes()
    signed = canonical.pack({k: v for k, v in second.fields.items() if k != "sig"})
    payload = second.fields["payload"]
    lines = [
        "Keys (Ed25519 seeds are the raw 32-byte private keys):",
        "",
        "```text",
        f"root seed        {ROOT_SEED.hex()}",
        f"root public key  {root_pub.hex()}   (the trust anchor)",
        f"root key id      {key_id_of(root_pub)}   (BLAKE3(public key), first 16 hex)",
        f"user seed        {USER_SEED.hex()}",
        f"user public key  {user_pub.hex()}",
        f"user key id      {key_id_of(user_pub)}",
        "```",
        "",
        "The root's certificate for the user key, as the registration's payload carries it:",
        "",
        "```json",
        json.dumps(cert_dict, indent=2),
        "```",
        "",
        "The bytes the root signed (the certificate without `sig`, canonical MessagePack, "
        f"{len(cert_signed)} bytes):",
        "",
        "```text",
        _wrap(cert_signed.hex()),
        "```",
        "",
        f"**Message 1**, stream sequence 1, subject `{first.subject}`, header "
        f"`Nats-Msg-Id: {first.id}`: the key registration, chain position 0 "
        f"({len(first.wire)} bytes on the wire):",
        "",
        "```text",
        _wrap(first.wire.hex()),
        "```",
        "",
        f"Its chain hash, BLAKE3 of those bytes: `{blake3.blake3(first.wire).hexdigest()}`.",
        "",
        f"**Message 2**, stream sequence 2, subject `{second.subject}`, header "
        f"`Nats-Msg-Id: {second.id}`: a `sandbox.stop_requested` at chain position 1. Its "
        "fields in canonical order:",
        "",
        *_fields_table(dict(sorted(second.fields.items()))),
        "",
        "The payload map: "
        + ", ".join(f"`{k}` = `{json.dumps(v)}`" for k, v in payload.items())
        + f" → `{canonical.pack(payload).hex()}` (note `5.0` as float 64: `cb 40 14 00 …`).",
        "",
        f"The signed bytes: the 16 fields without `sig` (a map 16 of 16 entries: `de 00 10`), "
        f"{len(signed)} bytes:",
        "",
        "```text",
        _wrap(signed.hex()),
        "```",
        "",
        f"Ed25519 signature with the user key: `{second.fields['sig']}`.",
        "",
        f"The wire bytes: all 17 fields (`de 00 11`), {len(second.wire)} bytes:",
        "",
        "```text",
        _wrap(second.wire.hex()),
        "```",
    ]
    return "\n".join(lines) + "\n"


def catalog() -> str:
    """The event table of docs/events.md: subject, version and who may publish each type."""
    from dsec_core.authz import PRODUCERS
    from dsec_core.events import EVENT_MODELS
    from dsec_core.schema import channel_address

    lines = [
        "| type | subject | schema_version | terminal | may be published by (roles) |",
        "|---|---|---|---|---|",
    ]
    for model in sorted(EVENT_MODELS, key=lambda m: (m.AGGREGATE, m.TYPE)):
        roles = ", ".join(sorted(PRODUCERS[model.TYPE]))
        terminal = "yes" if model.TERMINAL else ""
        lines.append(
            f"| `{model.TYPE}` | `{channel_address(model)}` | {model.VERSION} | {terminal} "
            f"| {roles} |"
        )
    return "\n".join(lines) + "\n"


def jsonl() -> str:
    """The two messages as the verifier reads them (stream order)."""
    _, _, sealed = seal_example()
    return "".join(
        json.dumps(
            {
                "seq": seq,
                "subject": s.subject,
                "headers": {"Nats-Msg-Id": s.id},
                "data": s.wire.hex(),
            }
        )
        + "\n"
        for seq, s in enumerate(sealed, start=1)
    )


def anchor() -> str:
    """The example's trust anchor (root public key, hex)."""
    return bytes(SigningKey(ROOT_SEED).verify_key).hex()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", type=Path, help="also write the messages (verifier input)")
    parser.add_argument("--catalog", action="store_true", help="print the event table instead")
    options = parser.parse_args()
    print(catalog() if options.catalog else markdown(), end="")
    if options.jsonl is not None:
        options.jsonl.write_text(jsonl())


if __name__ == "__main__":
    main()
