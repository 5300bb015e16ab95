"""What the signed requests outside the stream share (dsec_core.rpc)."""

from __future__ import annotations

import logging

import pytest
from dsec_core import rpc


@pytest.mark.parametrize(
    ("reply", "ok"),
    [
        ("_INBOX.user-acme.abc.1", True),
        ("_INBOX.operator.abc", True),  # the operator's CLI
        ("_INBOX.Xk3abc", True),  # a connection with nats-py's shared prefix
        ("_INBOX.scheduler.abc.1", False),
        ("_INBOX.policy.abc", False),
        ("_INBOX.nodeagent.abc", False),
        ("_INBOX.nodeagent-gpu-a.abc", False),
        ("_INBOX.fleetsim.abc", False),
        ("dsec.sandbox.x.ready", False),
        ("", False),
    ],
)
def test_answers_go_to_a_persons_inbox_never_to_a_services(reply: str, ok: bool) -> None:
    """A request names its reply subject: a service answering there must not drop messages
    among another service's own replies."""
    assert rpc.answerable(reply) is ok


def test_a_flood_of_refusals_is_one_line_per_period_and_cannot_forge_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = rpc.RefusalLog(logging.getLogger("test.rpc"), "request", every_s=3600)
    with caplog.at_level(logging.WARNING, logger="test.rpc"):
        refusals.refused("x" * 10_000 + "\nFAKE: all good", "bad-signature", "d\nFAKE")
        for _ in range(50):
            refusals.refused("r", "bad-signature", "d")
    [record] = caplog.records
    line = record.getMessage()
    assert "\n" not in line and len(line) < 400, line


def test_the_request_hash_names_exact_bytes() -> None:
    assert rpc.request_hash(b"a") != rpc.request_hash(b"b")
    assert len(rpc.request_hash(b"a")) == 32
