"""Pure decisions of the embedded stack."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from dsec_cli.stack import domain
from dsec_cli.stack.adapters.servers import PrometheusServer
from dsec_cli.stack.domain import State
from dsec_cli.stack.errors import StackConfigError, StackStateError

pytestmark = pytest.mark.unit


def test_redact_url_drops_the_password_only() -> None:
    dsn = domain.postgres_dsn("s3cr3t", 5432)
    assert dsn == "postgresql://dsec:s3cr3t@127.0.0.1:5432/dsec"
    assert domain.redact_url(dsn) == "postgresql://dsec@127.0.0.1:5432/dsec"
    assert domain.redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_redact_url_drops_a_nats_token_or_user_and_password() -> None:
    token, userpass = "nats://s3cr3t@10.0.0.5:4222", "nats://app:pw@10.0.0.5:4222"
    assert domain.redact_url(token, user_is_secret=True) == "nats://10.0.0.5:4222"
    assert domain.redact_url(userpass, user_is_secret=True) == "nats://10.0.0.5:4222"
    assert domain.redact_url(token) == token  # a Postgres user alone is no secret


def test_state_round_trips_and_keeps_the_documented_top_level_keys() -> None:
    st = domain.StackState(nats_url="nats://127.0.0.1:1", vault_token="tok")
    st.servers["nats"] = domain.ServerRecord(pid=1, create_time=2.0, ports=[1, 2])
    parsed = domain.parse_state(st.to_json(), "stack.json")
    assert parsed == st
    assert list(domain.StackState.model_fields) == [
        "nats_url", "postgres_dsn", "postgres_read_dsn", "s3_endpoint", "s3_access_key",
        "s3_secret_key", "vault_addr", "vault_token", "prometheus_url", "nodes", "servers",
        "services",
    ]  # fmt: skip


def test_secrets_are_not_in_the_repr() -> None:
    st = domain.StackState(postgres_dsn="postgresql://dsec:pw1@h:1/dsec", vault_token="tok2")
    st.servers["vault"] = domain.ServerRecord(credentials={"token": "tok3"})
    text = repr(st)
    assert "pw1" not in text and "tok2" not in text and "tok3" not in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{nope", "/h/stack.json: not valid JSON (line 1"),
        ("[]", "/h/stack.json: expected a JSON object, got list"),
        ('{"servers": {"nats": {"pid": "x"}}}', "/h/stack.json: field 'servers.nats.pid'"),
    ],
)
def test_bad_state_file_names_the_file_and_field(text: str, message: str) -> None:
    with pytest.raises(StackStateError) as info:
        domain.parse_state(text, "/h/stack.json")
    assert str(info.value).startswith(message)


def test_external_endpoints_accept_complete_settings() -> None:
    ext = domain.external_endpoints(
        {
            "nats_url": "nats://10.0.0.1:4222",
            "s3_endpoint": "minio:9000",
            "s3_access_key": "a",
            "s3_secret_key": "b",
        }
    )
    assert ext.names() == {"nats", "s3"}
    assert domain.external_endpoints({}).names() == frozenset()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"nats_url": "localhost:4222"}, "DSEC_NATS_URL='localhost:4222': expected nats://"),
        ({"postgres_dsn": "mysql://u:pw@h/db"}, "DSEC_POSTGRES_DSN='mysql://u@h/db'"),
        ({"s3_endpoint": "http://minio:9000", "s3_access_key": "a", "s3_secret_key": "b"},
         "DSEC_S3_ENDPOINT='http://minio:9000': expected HOST:PORT"),
        ({"s3_endpoint": "minio:9000", "s3_access_key": "a"},
         "DSEC_S3_ENDPOINT is set but DSEC_S3_SECRET_KEY is not"),
        ({"vault_addr": "vault:8200", "vault_token": "t"}, "DSEC_VAULT_ADDR='vault:8200'"),
    ],
)  # fmt: skip
def test_external_endpoints_reject_bad_input(values: dict[str, str], message: str) -> None:
    with pytest.raises(StackConfigError) as info:
        domain.external_endpoints(values)
    assert str(info.value).startswith(message)
    assert "pw" not in str(info.value)


def test_service_names_are_checked() -> None:
    assert domain.validate_service_names(["policy", "node_agent2"]) == ("policy", "node_agent2")
    with pytest.raises(StackConfigError, match="service 'Policy': expected a lowercase name"):
        domain.validate_service_names(["Policy"])
    with pytest.raises(StackConfigError, match="service 'policy' is listed twice"):
        domain.validate_service_names(["policy", "policy"])


def test_status_exit_code() -> None:
    assert domain.status_exit_code([State.RUNNING, State.EXTERNAL, State.ABSENT]) == 0
    assert domain.status_exit_code([State.RUNNING, State.STOPPED]) == 1
    assert domain.status_exit_code([State.UNHEALTHY]) == 1


def test_service_environment_has_every_endpoint_and_no_empty_values() -> None:
    st = domain.StackState(
        nats_url="nats://127.0.0.1:1",
        postgres_dsn="postgresql://dsec:pw@127.0.0.1:2/dsec",
        s3_endpoint="127.0.0.1:3",
        s3_access_key="ak",
        s3_secret_key="sk",
        vault_addr="http://127.0.0.1:4",
        vault_token="tok",
    )
    env = domain.service_environment(st, home="/h", metrics_port=9100, bucket="dsec")
    assert env == {
        "DSEC_HOME": "/h",
        "DSEC_METRICS_PORT": "9100",
        "DSEC_METRICS_HOST": "127.0.0.1",  # loopback whatever the operator's shell says
        "DSEC_NATS_URL": "nats://127.0.0.1:1",
        "DSEC_POSTGRES_DSN": "postgresql://dsec:pw@127.0.0.1:2/dsec",
        "DSEC_S3_ENDPOINT": "127.0.0.1:3",
        "DSEC_S3_ACCESS_KEY": "ak",
        "DSEC_S3_SECRET_KEY": "sk",
        "DSEC_VAULT_ADDR": "http://127.0.0.1:4",
        "DSEC_VAULT_TOKEN": "tok",
        "DSEC_S3_BUCKET": "dsec",
    }
    assert "DSEC_NATS_URL" not in domain.service_environment(
        domain.StackState(), home="/h", metrics_port=1
    )


def template_dir_alerts() -> Path:
    return PrometheusServer.template_path().with_name("alerts.yml")


def test_prometheus_config_scrapes_every_service(tmp_path: Path) -> None:
    template = PrometheusServer.template_path().read_text()
    text = domain.render_prometheus_config(
        template, services={"policy": 9101, "builder": 9102}, prometheus_port=9090
    )
    assert '{"targets": ["127.0.0.1:9101"], "labels": {"service": "policy"}}' in text
    assert '{"targets": ["127.0.0.1:9102"], "labels": {"service": "builder"}}' in text
    assert '["127.0.0.1:9090"]' in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed: rendered text checked, not Prometheus's parse")
    path = tmp_path / "prometheus.yml"
    path.write_text(text)
    # the alert rules `dsec up` copies beside it (checked by promtool too)
    (tmp_path / "alerts.yml").write_text(template_dir_alerts().read_text())
    result = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_template_with_unknown_placeholder_is_named() -> None:
    with pytest.raises(StackConfigError, match="unknown placeholder 'nope'"):
        domain.render_prometheus_config("x: ${nope}", services={}, prometheus_port=1)


def test_nodes_on_one_machine_are_bounded_with_a_clear_error() -> None:
    assert domain.check_nodes(1) == 1 and domain.check_nodes(domain.MAX_NODES) == domain.MAX_NODES
    for bad in (0, domain.MAX_NODES + 1):
        with pytest.raises(StackConfigError, match=f"--nodes {bad}: expected 1 to"):
            domain.check_nodes(bad)
    assert [domain.replicas_for(n) for n in (1, 2, 3, 5)] == [1, 2, 3, 3]


def test_extra_nodes_have_their_names_and_disjoint_sandbox_uids() -> None:
    name = domain.node_service_name(domain.node_id(2))
    assert name == "nodeagent@node-2" and domain.node_of_service(name) == "node-2"
    assert domain.node_of_service("nodeagent") is None
    assert domain.node_of_service("policy@node-2") is None
    assert domain.server_kind("nats-3") == "nats" and domain.server_kind("s3") == "s3"
    names = ["s3", "nats-3", "vault", "nats", "nats-2", "postgres"]
    assert sorted(names, key=domain.server_order) == [
        "nats", "nats-2", "nats-3", "postgres", "s3", "vault",
    ]  # fmt: skip
    bases = [
        int(domain.node_environment(domain.node_id(i))["DSEC_SANDBOX_UID_BASE"]) for i in (2, 3)
    ]
    assert (
        bases[1] - bases[0] == domain.NODE_UID_SPAN and bases[0] == 200_000 + domain.NODE_UID_SPAN
    )
    assert domain.node_environment("node-3")["DSEC_NODE_ID"] == "node-3"
