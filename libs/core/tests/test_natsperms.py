"""The NATS permissions table, the connect options and the stream check (pure)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from dsec_core import natsclient, natsperms
from dsec_core.bus import RETENTION_APPROVED_KEY, stream_config, stream_problems
from dsec_core.settings import Settings
from nats.js.api import DiscardPolicy, RetentionPolicy, StreamConfig

pytestmark = pytest.mark.unit

DEPLOY_CONF = Path(__file__).parents[3] / "deploy" / "nats" / "nats-server.conf"


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def may_publish(role: str, subject: str) -> bool:
    allowed = any(_matches(p, subject) for p in natsperms.publish_allow(role))
    return allowed and not any(_matches(p, subject) for p in natsperms.publish_deny(role))


@pytest.mark.parametrize(
    ("role", "subject", "allowed"),
    [
        ("policy", "dsec.sandbox.sbx_1.spec.validated", True),
        ("policy", "dsec.sandbox.sbx_1.env.built", False),
        ("policy", "dsec.sandbox.sbx_1.failed", True),
        ("policy", "dsec.security.policy.event_rejected", True),
        # registrations are filed by key id: any service may file one; consumers check its
        # root certificate (dsec_core.trust), not the subject
        ("builder", "dsec.producer.0123456789abcdef.audit.key_registered", True),
        ("user", "dsec.producer.0123456789abcdef.audit.key_revoked", False),
        ("policy", "$KV.dsec-handled.policy-spec-submitted.some-id", True),
        ("policy", "$KV.dsec-handled.builder-spec-validated.some-id", False),
        ("user", "$KV.dsec-handled.policy-spec-submitted.some-id", False),
        ("user", "dsec.producer.cli-0a1b2c3d4e5f.audit.key_registered", True),
        ("builder", "dsec.sandbox.sbx_1.env.built", True),
        ("builder", "dsec.sandbox.sbx_1.ready", False),
        ("nodeagent", "dsec.sandbox.sbx_1.policy.violation_summary", True),
        ("nodeagent", "dsec_ipc.group.agent.tool", True),
        ("nodeagent", "dsec.sandbox.sbx_1.spec.submitted", False),
        ("snapshot", "dsec.sandbox.sbx_1.snapshot.taken", True),
        ("scheduler", "dsec.node.n1.lost", True),
        ("user", "dsec.sandbox.sbx_1.spec.submitted", True),
        ("user", "dsec.sandbox.sbx_1.stop_requested", True),
        ("user", "dsec.sandbox.sbx_1.snapshot.restore_requested", True),
        ("user", "dsec.sandbox.sbx_1.spec.validated", False),
        ("user", "dsec.sandbox.sbx_1.failed", False),
        ("user", "dsec_ipc.group.agent.tool", False),
        ("operator", "$JS.API.STREAM.UPDATE.DSEC_EVENTS", True),
        # the simulated fleet: node events of any node (each signed by that node's key)
        ("fleetsim", "dsec.node.sim-1.heartbeat", True),
        ("fleetsim", "dsec.node.openb-node-0042.joined", True),
        ("fleetsim", "dsec.producer.0123456789abcdef.audit.key_registered", True),
        ("fleetsim", "dsec.sandbox.sbx_1.ready", True),
        ("fleetsim", "dsec.security.nodeagent-sim-1-sandbox-scheduled.event_rejected", True),
        ("fleetsim", "dsec.sandbox.sbx_1.scheduled", False),
        ("fleetsim", "dsec.node.sim-1.lost", False),
        ("fleetsim", "dsec.sandbox.sbx_1.spec.submitted", False),
        (
            "fleetsim",
            "$JS.API.CONSUMER.MSG.NEXT.DSEC_EVENTS.nodeagent-node-1-sandbox-scheduled",
            False,
        ),
        ("fleetsim", "$KV.dsec-handled.nodeagent-node-1-sandbox-scheduled.x", False),
    ],
)
def test_who_may_publish_what(role: str, subject: str, allowed: bool) -> None:
    assert may_publish(role, subject) is allowed


@pytest.mark.parametrize("role", [r for r in natsperms.ROLES if r != natsperms.OPERATOR])
@pytest.mark.parametrize(
    "subject",
    [
        "$JS.API.STREAM.CREATE.DSEC_EVENTS",
        "$JS.API.STREAM.UPDATE.DSEC_EVENTS",
        "$JS.API.STREAM.DELETE.DSEC_EVENTS",
        "$JS.API.STREAM.PURGE.DSEC_EVENTS",
        "$JS.API.STREAM.MSG.DELETE.DSEC_EVENTS",
        "$JS.API.CONSUMER.DELETE.DSEC_EVENTS.policy-spec-submitted",
        "$KV.dsec-configmaps.agent-configs.retrieval",
    ],
)
def test_only_the_operator_administers(role: str, subject: str) -> None:
    assert not may_publish(role, subject)


def test_a_role_consumes_its_own_durables_only() -> None:
    own = "$JS.API.CONSUMER.MSG.NEXT.DSEC_EVENTS.builder-spec-validated"
    assert may_publish("builder", own)
    assert may_publish("builder", "$JS.ACK.DSEC_EVENTS.builder-spec-validated.1.2.3.4.5.6")
    assert not may_publish("policy", own)
    assert not may_publish("user", own)
    assert not may_publish("policy", "$JS.ACK.DSEC_EVENTS.builder-spec-validated.1.2.3.4.5.6")
    assert not may_publish("user", "$JS.API.CONSUMER.CREATE.DSEC_EVENTS.builder-spec-validated")
    # ephemeral readers (random names) are fine for everyone
    assert may_publish("user", "$JS.API.CONSUMER.MSG.NEXT.DSEC_EVENTS.Xk3Pq9")
    assert may_publish("user", "$JS.API.CONSUMER.CREATE.DSEC_EVENTS.Xk3Pq9.dsec.sandbox.s.>")


def test_unknown_role_is_named() -> None:
    with pytest.raises(ValueError, match="unknown NATS role 'admin'; valid: operator"):
        natsperms.publish_allow("admin")


def test_deploy_config_is_generated_from_the_table() -> None:
    assert DEPLOY_CONF.read_text() == natsperms.render_deploy_config(), (
        "deploy/nats/nats-server.conf is stale: "
        "uv run python -m dsec_core.natsperms > deploy/nats/nats-server.conf"
    )


# --- connect options ---------------------------------------------------------------------


def test_options_pick_the_nkey_file(tmp_path: Path) -> None:
    seed = tmp_path / "policy.nk"
    seed.write_text("SUAAA\n")
    opts = natsclient.nats_options(
        Settings(nats_url="nats://h:1,nats://h:2", nats_nkey_seed=seed, home=tmp_path),
        name="x",
        max_reconnect_attempts=-1,
    )
    assert opts == {
        "servers": ["nats://h:1", "nats://h:2"],
        "name": "x",
        "nkeys_seed": str(seed),
        "inbox_prefix": "_INBOX.policy",  # the seed file names the identity
        "max_reconnect_attempts": -1,
    }


def test_url_credentials_win_and_default_user_is_for_the_embedded_stack(tmp_path: Path) -> None:
    default = natsclient.credential_path(tmp_path, natsclient.DEFAULT_USER_IDENTITY)
    default.parent.mkdir()
    default.write_text("SUAAA\n")
    embedded = natsclient.credential_options(Settings(home=tmp_path))
    assert embedded == {"nkeys_seed": str(default)}
    external = Settings(home=tmp_path, nats_url="nats://h:1")
    assert natsclient.credential_options(external) == {}
    in_url = Settings(home=tmp_path, nats_url="nats://u:p@h:1", nats_nkey_seed=default)
    assert natsclient.credential_options(in_url) == {}


def test_user_password_and_missing_files(tmp_path: Path) -> None:
    s = Settings(home=tmp_path, nats_url="nats://h:1", nats_user="u", nats_password="pw")
    assert natsclient.credential_options(s) == {"user": "u", "password": "pw"}
    assert "pw" not in repr(s)
    missing = Settings(home=tmp_path, nats_url="nats://h:1", nats_creds=tmp_path / "no.creds")
    with pytest.raises(natsclient.NatsSettingsError, match=r"DSEC_NATS_CREDS=.*no such file"):
        natsclient.nats_options(missing, name="x")


def test_each_identity_gets_its_own_inbox_and_may_subscribe_to_no_other(tmp_path: Path) -> None:
    """Replies go to ``_INBOX.<identity>``: the connect options pick the identity from the
    credential, and the server lets each identity subscribe to its own inboxes only."""
    home = tmp_path / "home"
    seed = natsclient.credential_path(home, natsclient.DEFAULT_USER_IDENTITY)
    seed.parent.mkdir(parents=True)
    seed.write_text("SUAAA\n")
    cases = {
        Settings(home=home): "_INBOX.user-default",
        Settings(home=home, nats_url="nats://h:1", nats_nkey_seed=seed.parent / "x.nk"): None,
        Settings(home=home, nats_url="nats://h:1", nats_user="user-acme"): "_INBOX.user-acme",
        Settings(home=home, nats_url="nats://scheduler:pw@h:1"): "_INBOX.scheduler",
        Settings(home=home, nats_url="nats://h:1"): None,
    }
    for settings, prefix in cases.items():
        if prefix is None and settings.nats_nkey_seed is not None:
            with pytest.raises(natsclient.NatsSettingsError):
                natsclient.inbox_options(settings)
            continue
        assert natsclient.inbox_options(settings).get("inbox_prefix") == prefix, settings
    identities = [
        natsperms.Identity("operator", user="operator", password_hash="h"),
        natsperms.Identity("user-acme", nkey="UA"),
        natsperms.Identity("user-other", nkey="UB"),
        natsperms.Identity("nodeagent-n2", nkey="UC"),
        natsperms.Identity("scheduler", nkey="UD"),
    ]
    for ident in identities[1:]:
        allowed = ident.entry(nodes=["n2"])["permissions"]["subscribe"]["allow"]
        inboxes = [s for s in allowed if s.startswith("_INBOX")]
        assert inboxes == [f"_INBOX.{ident.name}.>"], (ident.name, allowed)
    # the node agent still answers any requester's inbox (remote logs/exec)
    assert "_INBOX.>" in natsperms.publish_allow("nodeagent")
    with pytest.raises(ValueError, match="NATS identity"):
        natsperms.inbox_prefix("a.b")


def test_tls_settings(tmp_path: Path) -> None:
    half = Settings(home=tmp_path, nats_url="tls://h:1", nats_tls_cert=tmp_path / "c.pem")
    with pytest.raises(natsclient.NatsSettingsError, match="go together"):
        natsclient.tls_context(half)
    assert natsclient.tls_context(Settings(home=tmp_path)) is None
    ctx = natsclient.tls_context(
        Settings(
            home=tmp_path,
            nats_url="tls://h:1",
            nats_tls_ca=Path(
                ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt"
            ),
        )
    )
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED


def test_broker_options_use_faststream_security(tmp_path: Path) -> None:
    from faststream.nats.security import NatsNKey

    seed = tmp_path / "s.nk"
    seed.write_text("SUAAA\n")
    opts = natsclient.broker_options(
        Settings(home=tmp_path, nats_url="nats://h:1", nats_nkey_seed=seed), name="x"
    )
    assert isinstance(opts["security"], NatsNKey) and "nkeys_seed" not in opts
    assert opts["inbox_prefix"] == "_INBOX.s"


# --- the stream check ----------------------------------------------------------------------


def _config(**changes: object) -> StreamConfig:
    config = stream_config()
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_the_stream_dsec_declares_is_sound() -> None:
    assert stream_problems(stream_config()) == []


def test_a_replicated_stream_is_sound_and_still_refused_when_weakened() -> None:
    replicated = stream_config(3)  # `dsec up --nodes 3`: the log on three servers
    assert replicated.num_replicas == 3 and stream_problems(replicated) == []
    replicated.deny_purge = False
    assert stream_problems(replicated) == ["deny_purge is off (the stream can be purged)"]


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"deny_delete": False}, "deny_delete is off"),
        ({"deny_purge": False}, "deny_purge is off"),
        ({"max_msgs": 10}, "max_msgs=10 with discard=old would lose events"),
        ({"max_age": 3600.0, "discard": DiscardPolicy.NEW}, "max_age=3600.0 with discard=new"),
        ({"retention": RetentionPolicy.WORK_QUEUE}, "retention is"),
        ({"allow_rollup_hdrs": True}, "allow_rollup_hdrs is on"),
        ({"subjects": ["dsec.sandbox.>"]}, "do not capture dsec.>"),
    ],
)
def test_weakened_stream_is_named(changes: dict[str, object], problem: str) -> None:
    problems = stream_problems(_config(**changes))
    assert any(problem in p for p in problems), problems


def test_limits_the_operator_approved_are_accepted() -> None:
    approved = _config(max_age=86400.0, metadata={RETENTION_APPROVED_KEY: "true"})
    assert stream_problems(approved) == []
    assert stream_problems(_config(max_msgs=-1, max_bytes=-1)) == []


def test_a_node_agent_uses_only_its_own_nodes_durables() -> None:
    def may(identity: str, subject: str) -> bool:
        node = natsperms.node_of_identity(identity)
        role = natsperms.role_of_identity(identity)
        allow = natsperms.publish_allow(role, node)
        deny = natsperms.publish_deny(role, node, ["node-1", "n2"])
        return any(_matches(p, subject) for p in allow) and not any(
            _matches(p, subject) for p in deny
        )

    assert natsperms.role_of_identity("nodeagent-n2") == "nodeagent"
    mine = "nodeagent-n2-sandbox-scheduled"
    theirs = "nodeagent-node-1-sandbox-scheduled"
    assert natsperms.durable_name("nodeagent", "sandbox.scheduled", "n2") == mine
    for durable, allowed in ((mine, True), (theirs, False)):
        for subject in (
            f"$JS.API.CONSUMER.DURABLE.CREATE.DSEC_EVENTS.{durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.DSEC_EVENTS.{durable}",
            f"$JS.ACK.DSEC_EVENTS.{durable}.1.2.3.4.5.6",
            f"$KV.dsec-handled.{durable}.some-id",
        ):
            assert may("nodeagent-n2", subject) is allowed, subject
    # the plain identity is the single-node stack's node-1 and may not reach n2's durables
    assert may("nodeagent", f"$JS.API.CONSUMER.MSG.NEXT.DSEC_EVENTS.{theirs}")
    assert not may("nodeagent", f"$JS.API.CONSUMER.MSG.NEXT.DSEC_EVENTS.{mine}")
    assert not may("policy", f"$JS.API.CONSUMER.MSG.NEXT.DSEC_EVENTS.{theirs}")
    with pytest.raises(ValueError, match=r"node id 'a\.b' must match"):
        natsperms.durable_name("nodeagent", "sandbox.scheduled", "a.b")


def test_the_rendered_config_fences_each_node_agent_off_the_others() -> None:
    identities = [natsperms.Identity(n, nkey="U" + n) for n in ("nodeagent", "nodeagent-n2")]
    text = natsperms.render_authorization(identities)
    assert "nodeagent-n2-sandbox-scheduled" in text and "nodeagent-node-1-unit-lost" in text
    n2 = identities[1].entry(nodes=["node-1", "n2"])["permissions"]["publish"]
    assert "$JS.API.CONSUMER.MSG.NEXT.DSEC_EVENTS.nodeagent-node-1-sandbox-scheduled" in n2["deny"]


def test_each_node_agent_of_a_machine_has_its_own_egress_directories() -> None:
    pins, state = Settings(node_id="node-2", home=Path("/srv/a")).egress_dirs()
    assert pins.parent.name.startswith("dsec-node-2-") and pins.name == "egress"
    assert state.parent.name == pins.parent.name and state.parent.parent == Path("/run")
    assert Settings(node_id="node-3", home=Path("/srv/a")).egress_dirs()[0] != pins
    # another stack's node-2 on the same machine (another home) has directories of its own
    assert Settings(node_id="node-2", home=Path("/srv/b")).egress_dirs()[0] != pins
    assert Settings(node_id="node-2", home=Path("/srv/a")).egress_dirs() == (pins, state)
    assert Settings(node_id="n", bpf_pin_dir=Path("/sys/fs/bpf/x")).egress_dirs()[0] == Path(
        "/sys/fs/bpf/x/egress"
    )
    with pytest.raises(ValueError, match=r"DSEC_NODE_ID '\.\./x': letters, digits"):
        Settings(node_id="../x").egress_dirs()
