"""What the node agent and the snapshot service read from a sandbox's events, who acts on it,
and when a request is refused (pure)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.lifecycle import fold_envelopes
from dsec_core.signing import Signer
from dsec_testing.plans import minimal_plan
from nacl.signing import SigningKey

from dsec_snapstore import sandboxes
from dsec_snapstore.manifest import DepsRecord
from dsec_snapstore.sandboxes import SandboxFacts

pytestmark = pytest.mark.unit

SID = "sbx_test"
ROOT = Path("/home/dsec/sandboxes")
SIGNER = Signer("test", SigningKey.generate())


def env(payload: events.Payload) -> Envelope:
    return SIGNER.seal(payload, aggregate_id=SID).envelope


PLAN = minimal_plan(
    "x",
    "entrypoint: [python, a.py]\ninclude_code:\n  exclude_patterns: ['*.ckpt']\n"
    "runtime_context:\n  env_vars:\n    - name: MODE\n      value: eval\n",
)


def lifecycle(*extra: events.Payload) -> list[Envelope]:
    payloads: list[events.Payload] = [
        events.SpecSubmitted(spec_yaml="name: x"),
        events.SpecValidated(name="x", spec_digest="d", plan=PLAN),
        events.DepsResolved(
            lock=[
                events.LockedPackage(name="msgpack", version="1.1.0", sha256="ab", source="pypi")
            ],
            lock_hash="lh",
            python="3.11",
            platform="linux",
            resolve_ms=1,
        ),
        events.EnvBuilt(
            lock_hash="lh",
            fingerprint="fp-1",
            object_key="envs/lh.tar.zst",
            digest="d",
            size_bytes=1,
            reused=False,
        ),
        events.ContextInjected(kind="secret", name="API_KEY", source="vault://k", digest="sd1"),
        events.SandboxReady(node_id="n1", pid=1, cgroup="/cg", code_dir=f"{ROOT}/{SID}/code"),
        *extra,
    ]
    return [env(p) for p in payloads]


def facts(*extra: events.Payload) -> SandboxFacts:
    return SandboxFacts.from_events(SID, lifecycle(*extra))


def ready_at(code_dir: str) -> SandboxFacts:
    forged = events.SandboxReady(node_id="n1", pid=1, cgroup="/cg", code_dir=code_dir)
    return SandboxFacts.from_events(SID, [*lifecycle()[:-1], env(forged)])


def test_facts_record_the_environment_and_secret_digests_never_values() -> None:
    f = facts()
    assert f.running and sandboxes.code_dir_refusal(f, ROOT / SID / "code") is None
    assert sandboxes.exclude_patterns(f) == ("*.ckpt",)
    assert sandboxes.env_values(f) == {"MODE": "eval", "API_KEY": "secret-digest:sd1"}
    deps = sandboxes.deps_record(f)
    assert deps is not None and deps.fingerprint == "fp-1" and deps.packages[0].name == "msgpack"


def test_create_is_refused_for_unknown_sandboxes_and_full_state() -> None:
    request = events.SnapshotRequested(name="s")
    unknown = SandboxFacts.from_events(SID, [])
    assert "no sandbox 'sbx_test' in the event log" in str(
        sandboxes.create_refusal(unknown, request)
    )
    full = events.SnapshotRequested(name="s", full_state=True)
    assert "not supported" in str(sandboxes.create_refusal(facts(), full))
    assert sandboxes.create_refusal(facts(), request) is None


def owner(f: SandboxFacts, *extra: events.Payload) -> str | None:
    envelopes = lifecycle(*extra)
    return sandboxes.acting_node(fold_envelopes(envelopes), f)


def test_the_node_that_runs_a_sandbox_acts_for_it_and_nobody_once_it_ended() -> None:
    assert owner(facts()) == "n1"  # started without the scheduler: sandbox.ready names it
    exited = events.SandboxExited(exit_code=0, reason="ok", duration_s=1)
    assert owner(facts(exited), exited) is None
    assert sandboxes.acting_node(fold_envelopes([]), SandboxFacts.from_events(SID, [])) is None


def test_a_scheduled_sandbox_is_acted_for_by_the_scheduled_node() -> None:
    scheduled = events.SandboxScheduled(node_id="n2", attempt=1)
    payloads = [
        events.SpecSubmitted(spec_yaml="x"),
        events.SpecValidated(name="x", spec_digest="d", plan=PLAN),
    ]
    base = [env(p) for p in payloads]
    resolved = lifecycle()[2:4]  # deps.resolved, env.built
    history = [*base, *resolved, env(scheduled)]
    f = SandboxFacts.from_events(SID, history)
    assert sandboxes.acting_node(fold_envelopes(history), f) == "n2"


def test_restore_of_a_sandbox_running_nowhere_says_why() -> None:
    exited = facts(events.SandboxExited(exit_code=0, reason="ok", duration_s=1))
    assert "has exited" in sandboxes.not_running(exited, "s")
    assert "dsec sandbox run --snapshot s" in sandboxes.not_running(exited, "s")
    assert "is not running" in sandboxes.not_running(SandboxFacts.from_events(SID, []), "s")


@pytest.mark.parametrize("elsewhere", ["/root/.ssh", f"{ROOT}/sbx_other/code", f"{ROOT}/../x"])
def test_a_code_dir_outside_the_node_layout_is_never_used(elsewhere: str) -> None:
    forged = ready_at(elsewhere)
    refusal = sandboxes.code_dir_refusal(forged, ROOT / SID / "code")
    assert "not where this node keeps its code" in str(refusal)


def test_a_different_environment_is_reported_not_faked() -> None:
    built = facts().built
    same = DepsRecord(fingerprint="fp-1", lock_hash="lh")
    other = DepsRecord(fingerprint="fp-0", lock_hash="lh0")
    assert sandboxes.deps_verdict(same, built) == (True, "")
    match, note = sandboxes.deps_verdict(other, built)
    assert match is False and "cannot be" in note and "dsec sandbox run --snapshot" in note
    assert sandboxes.deps_verdict(None, built)[0] is None


def test_audit_segment_keeps_the_signed_wire_bytes_with_their_sequence() -> None:
    records = [(3, b"\x81a\x01"), (7, b"\x81b\x02")]
    assert msgpack.unpackb(sandboxes.audit_segment(records)) == [
        [3, b"\x81a\x01"],
        [7, b"\x81b\x02"],
    ]
