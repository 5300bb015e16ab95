"""Loading specs: valid specs load, every mistake is reported at its line with what is valid."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.spec import SandboxSpec, Severity, SpecError, load_spec
from pydantic import ValidationError

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "spec_fixtures"
REPO = Path(__file__).resolve().parents[3]

MINIMAL = 'version: "1.2"\nname: demo\nbase: dsec/python311:latest\n'


def errors_of(text: str | bytes) -> list[SpecError]:
    result = load_spec(text, "spec.yaml")
    assert result.spec is None, "expected the spec to be rejected"
    assert result.errors
    return list(result.errors)


def only_error(text: str | bytes) -> SpecError:
    errors = errors_of(text)
    assert len(errors) == 1, [e.format() for e in errors]
    return errors[0]


def test_brief_example_validates_with_typed_values() -> None:
    result = load_spec((FIXTURES / "agent-train-sandbox.yaml").read_text(), "brief.yaml")
    assert result.ok, [e.format() for e in result.errors]
    spec = result.spec
    assert spec is not None
    env = spec.runtime_context.env_vars[0]
    assert env.effective_ttl.total_seconds() == 7200
    assert env.vault is not None and (env.vault.mount, env.vault.path, env.vault.key) == (
        "prod",
        "agent-tools/websearch-key",
        "value",
    )  # no #key: the documented default
    rule = spec.security_policy.network.egress[0]
    assert rule.rate_limit is not None and rule.rate_limit.requests == 100
    assert rule.rate_limit.period_s == 60
    assert spec.runtime_context.mounts[0].cache_ttl is not None


def test_example_specs_in_the_repo() -> None:
    good = load_spec((REPO / "examples/websearch-agent/dsec.yaml").read_text(), "good.yaml")
    assert good.ok and not good.warnings
    bad = load_spec((REPO / "examples/bad-spec/dsec.yaml").read_bytes(), "bad.yaml")
    assert len(bad.errors) == 6
    assert len({e.rule_id for e in bad.errors} | {e.path for e in bad.errors}) >= 6
    assert [e.line for e in bad.errors] == [4, 10, 15, 21, 26, 29]


def test_unknown_field_points_at_the_key_and_suggests_the_field() -> None:
    error = only_error(MINIMAL + "depndencies: []\n")
    assert (error.line, error.column, error.rule_id) == (4, 1, "unknown-field")
    assert error.hint is not None and "did you mean 'dependencies'" in error.hint
    assert "spec.yaml:4:1: error[unknown-field]: depndencies" in error.format()


def test_nested_unknown_field_suggests_within_its_model() -> None:
    text = MINIMAL + "runtime_context:\n  env_vars:\n    - name: A\n      valeu: x\n"
    errors = errors_of(text)
    unknown = next(e for e in errors if e.rule_id == "unknown-field")
    assert unknown.path == "runtime_context.env_vars[0].valeu"
    assert (unknown.line, unknown.column) == (7, 7)
    assert unknown.hint is not None and "did you mean 'value'" in unknown.hint
    # The between-field rule of the same mapping is reported too, not hidden by the first error.
    assert any("exactly one of `value` or `source`" in e.message for e in errors)


def test_missing_required_field_is_named_with_an_example() -> None:
    error = only_error('version: "1.2"\nname: demo\n')
    assert error.rule_id == "missing-field"
    assert error.path == "base"
    assert "missing required field 'base'" in error.message
    assert error.hint is not None and "base: dsec/python311:latest" in error.hint


def test_yaml_syntax_error_is_located() -> None:
    error = only_error(MINIMAL + "resources:\n  cpu: [1, 2\n  memory: 1GiB\n")
    assert error.rule_id == "yaml-syntax"
    assert error.line in (5, 6)
    assert error.message.startswith("YAML syntax error")


def test_tab_indentation_gets_a_hint() -> None:
    error = only_error(MINIMAL + "resources:\n\tcpu: 1\n")
    assert (error.line, error.column) == (5, 1)
    assert error.hint is not None and "spaces" in error.hint


def test_duplicate_keys_are_errors_not_silently_overwritten() -> None:
    error = only_error(MINIMAL + "name: other\n")
    assert error.rule_id == "duplicate-key"
    assert (error.line, error.column) == (4, 1)
    assert "first at line 2" in error.message


@pytest.mark.parametrize(
    ("snippet", "path", "needle"),
    [
        ("name: Bad_Name", "name", "did you mean 'bad-name'"),
        ("resources: {memory: 2 gigs}", "resources.memory", "512MiB"),
        ("timeout: forever", "timeout", "such as 300s"),
        ("entrypoint: [python, 3]", "entrypoint[1]", 'quote it: "3"'),
        ("dependencies: [{package: rich, version: '=>13'}]", "dependencies[0].version", "PEP"),
        ("dependencies: [{package: rich, version: 13}]", "dependencies[0].version", "quote it"),
        ("dependencies: [{package: 'rich>=13'}]", "dependencies[0].package", "version:"),
        ("dependencies: [{package: rich}, {package: Rich}]", "dependencies[1].package", "merge"),
        (
            "dependencies: [{package: a, markers: 'python_version >'}]",
            "dependencies[0].markers",
            "sys_platform",
        ),
        (
            "security_policy: {filesystem: {write_allowed: /tmp}}",
            "security_policy.filesystem.write_allowed",
            "[/tmp]",
        ),
        (
            "security_policy: {filesystem: {read_allowed: [data]}}",
            "security_policy.filesystem.read_allowed[0]",
            "absolute",
        ),
        (
            "security_policy: {network: {egress: [{domain: 'a b'}]}}",
            "security_policy.network.egress[0].domain",
            "wildcard",
        ),
        (
            "security_policy: {network: {egress: [{cidr: 10.0.0.1/8}]}}",
            "security_policy.network.egress[0].cidr",
            "10.0.0.0/8",
        ),
        (
            "security_policy: {network: {egress: [{domain: a.test, ports: [70000]}]}}",
            "security_policy.network.egress[0].ports[0]",
            "65535",
        ),
        (
            "security_policy: {network: {egress: [{cidr: 8.8.8.8, allow_internal_only: true}]}}",
            "security_policy.network.egress[0].cidr",
            "private",
        ),
        (
            "security_policy: {network: {egress: [{domain: a.test, rate_limit: 10bananas/min}]}}",
            "security_policy.network.egress[0].rate_limit",
            "connects",
        ),
        (
            "security_policy: {network: {egress: [{cidr: 10.0.0.0/8, tls_proxy: true, "
            "rate_limit: 10req/min}]}}",
            "security_policy.network.egress[0].tls_proxy",
            "domain: api.example.com",
        ),
        (
            "security_policy: {network: {egress: [{domain: a.test, tls_proxy: true}]}}",
            "security_policy.network.egress[0].rate_limit",
            "100requests/min",
        ),
        (
            "security_policy: {network: {egress: [{domain: a.test, tls_proxy: true, "
            "rate_limit: 10connects/min}]}}",
            "security_policy.network.egress[0].rate_limit",
            "100requests/min",
        ),
        (
            "security_policy: {network: {egress: [{domain: a.test, protocol: icmp}]}}",
            "security_policy.network.egress[0].protocol",
            "udp",
        ),
        (
            "security_policy: {network: {egress: [{domain: a.test, protocol: udp, "
            "protocols: [tcp]}]}}",
            "security_policy.network.egress[0]",
            "protocols: [tcp, udp]",
        ),
        (
            "runtime_context: {env_vars: [{name: A, source: 'vault:/x'}]}",
            "runtime_context.env_vars[0].source",
            "vault://MOUNT/PATH",
        ),
        (
            "runtime_context: {env_vars: [{name: A, value: x, ttl: 1h}]}",
            "runtime_context.env_vars[0].ttl",
            None,
        ),
        (
            "runtime_context: {env_vars: [{name: A, value: x}, {name: A, value: y}]}",
            "runtime_context.env_vars[1].name",
            None,
        ),
        (
            "runtime_context: {mounts: [{path: /d, source: 'ftp://x/y'}]}",
            "runtime_context.mounts[0].source",
            "s3://BUCKET/PREFIX/",
        ),
        (
            "runtime_context: {mounts: [{path: /dsec/data, source: 's3://bkt/p/'}]}",
            "runtime_context.mounts[0].path",
            "a path outside /dsec, e.g. /workspace/data",
        ),
        (
            "runtime_context: {mounts: [{path: /, source: 's3://bkt/p/', mode: rw}]}",
            "runtime_context.mounts[0].path",
            "a path outside /dsec, e.g. /workspace/data",
        ),
        (
            "runtime_context: {mounts: [{path: /d, source: 'configmap://c/k', mode: rw}]}",
            "runtime_context.mounts[0].mode",
            "mode: ro",
        ),
        (
            "runtime_context: {mounts: [{path: /d, source: 's3://b/p/', mode: rx}]}",
            "runtime_context.mounts[0].mode",
            "ro-encrypted",
        ),
        (
            "security_policy: {semantic: [{on: open, match: {url: x}, action: deny}]}",
            "security_policy.semantic[0].match.url",
            "match on path",
        ),
        (
            "security_policy: {semantic: [{on: http, match: {url: x}, action: redirect}]}",
            "security_policy.semantic[0]",
            "target:",
        ),
        (
            "security_policy: {semantic: [{on: open, match: {path: /x}, action: log, target: /y}]}",
            "security_policy.semantic[0].target",
            None,
        ),
        (
            "security_policy: {semantic: [{on: exec, match: {path: /x}, action: deny}]}",
            "security_policy.semantic[0].on",
            "subprocess",
        ),
        ("resources: [1]", "resources", "fields: cpu, memory, pids, gpu"),
        (
            "runtime_context: {env_vars: [{name: PYTHONNOUSERSITE, value: '1'}]}",
            "runtime_context.env_vars[0].name",
            "remove PYTHONNOUSERSITE",
        ),
    ],
)
def test_each_mistake_is_located_with_what_is_valid(
    snippet: str, path: str, needle: str | None
) -> None:
    text = MINIMAL.replace("name: demo\n", "") if snippet.startswith("name:") else MINIMAL
    errors = errors_of(text + snippet + "\n")
    error = next((e for e in errors if e.path == path), None)
    assert error is not None, [e.format() for e in errors]
    assert error.line == text.count("\n") + 1
    if needle is not None:
        assert needle in f"{error.message} {error.hint}"


def test_every_error_is_reported_at_once_in_line_order() -> None:
    text = (
        'version: "1.2"\nname: X\nbase: dsec/python311:latest\n'
        "resources: {memory: lots, pids: 0}\ntimeout: never\ncolour: red\n"
    )
    errors = errors_of(text)
    assert [(e.line, e.path) for e in errors] == [
        (2, "name"),
        (4, "resources.memory"),
        (4, "resources.pids"),
        (5, "timeout"),
        (6, "colour"),
    ]


def test_yes_no_on_off_stay_strings_so_on_is_a_field_name() -> None:
    text = MINIMAL + (
        "security_policy:\n  semantic:\n    - on: subprocess\n      match: {argv: 'curl *'}\n"
        "      action: log\n"
    )
    result = load_spec(text)
    assert result.ok, [e.format() for e in result.errors]
    assert result.spec is not None
    rule = result.spec.security_policy.semantic[0]
    assert (rule.on, rule.match.argv) == ("subprocess", ("curl", "*"))


@pytest.mark.parametrize("fixture", ["spec-v1.0.yaml", "spec-v1.1.yaml"])
def test_older_versions_migrate_with_warnings_at_the_old_keys(fixture: str) -> None:
    result = load_spec((FIXTURES / fixture).read_text(), fixture)
    assert result.ok, [e.format() for e in result.errors]
    assert result.spec is not None and result.spec.version == "1.2"
    deprecated = [w for w in result.warnings if w.rule_id == "deprecated-field"]
    assert deprecated and all(w.severity is Severity.WARNING for w in deprecated)
    text = (FIXTURES / fixture).read_text().splitlines()
    for warning in deprecated:
        old = warning.message.split("'")[1]
        assert text[warning.line - 1].strip().lstrip("- ").startswith(old)


def test_v10_fields_land_in_their_new_places() -> None:
    result = load_spec((FIXTURES / "spec-v1.0.yaml").read_text())
    assert result.spec is not None
    policy = result.spec.security_policy
    assert policy.network.egress[0].domain == "api.example.test"
    assert policy.network.egress[0].ports == (443,)
    assert policy.filesystem.read_allowed == ("/data",)


def test_errors_after_migration_still_point_at_the_users_line() -> None:
    text = 'version: "1.0"\nname: a\nbase: b\nsecurity_policy:\n  network:\n    egress:\n'
    text += "      - host: 'not a host'\n"
    errors = errors_of(text)
    assert [(e.line, e.path) for e in errors] == [(7, "security_policy.network.egress[0].domain")]


def test_unsupported_version_lists_the_supported_ones() -> None:
    error = only_error(MINIMAL.replace('"1.2"', '"2.0"'))
    assert error.rule_id == "version" and error.line == 1
    assert error.hint is not None and "1.0, 1.1, 1.2" in error.hint


def test_unquoted_version_is_accepted_with_a_warning() -> None:
    result = load_spec(MINIMAL.replace('"1.2"', "1.2"))
    assert result.ok
    assert any('version: "1.2"' in (w.hint or "") for w in result.warnings)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("", "empty"),
        ("# only a comment\n", "empty"),
        ("- a\n- b\n", "not-a-mapping"),
        ("just text", "not-a-mapping"),
        ("a: 1\n---\nb: 2\n", "yaml-syntax"),
        ("a: !custom 1\n", "yaml-syntax"),
        ("a: &x [*x]\n", "yaml"),
        ("? [a]\n: 1\n", "yaml"),
    ],
)
def test_odd_documents_give_located_errors(text: str, rule: str) -> None:
    error = errors_of(text)[0]
    assert error.rule_id == rule
    assert error.line >= 1 and error.column >= 1


def test_non_utf8_bytes_are_located() -> None:
    error = only_error(MINIMAL.encode() + b"# caf\xe9\n")
    assert (error.rule_id, error.line) == ("encoding", 4)


def test_plain_value_for_a_secret_looking_name_warns() -> None:
    result = load_spec(MINIMAL + "runtime_context: {env_vars: [{name: API_TOKEN, value: abc}]}\n")
    assert result.ok
    assert [w.rule_id for w in result.warnings] == ["plain-secret"]


def test_spec_errors_are_frozen_and_survive_json() -> None:
    error = only_error(MINIMAL + "oops: 1\n")
    with pytest.raises(ValidationError):
        error.line = 3  # type: ignore[misc]
    assert SpecError.model_validate_json(error.model_dump_json()) == error


def test_spec_models_are_frozen_and_round_trip() -> None:
    result = load_spec((FIXTURES / "agent-train-sandbox.yaml").read_text())
    assert result.spec is not None
    again = SandboxSpec.model_validate(result.spec.model_dump(mode="json"))
    assert again == result.spec


def test_missing_field_in_a_list_item_points_at_that_item() -> None:
    text = MINIMAL + (
        "security_policy:\n  semantic:\n    - on: open\n      match: {path: /x}\n"
        "      action: deny\n    - {on: open, match: {path: /y}}\n"
    )
    error = only_error(text)
    assert (error.path, error.line, error.column) == ("security_policy.semantic[1].action", 9, 7)
