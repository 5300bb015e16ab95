"""Pure decisions of the embedded stack (no I/O).

The schema of ``$DSEC_HOME/stack.json``, the state of each component as ``dsec status`` shows it,
the exit code that follows, which servers are external, the environment a service gets, and the
Prometheus configuration rendered from its template.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from enum import StrEnum
from string import Template
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec_cli.stack.errors import StackConfigError, StackStateError

SERVER_NAMES: tuple[str, ...] = ("nats", "postgres", "s3", "vault", "prometheus")
"""Every server of the stack, in the order tables show them."""

CORE_SERVERS: tuple[str, ...] = ("nats", "postgres", "s3", "vault")
"""The servers every service needs; Prometheus is optional."""

DEFAULT_SERVICES: tuple[str, ...] = ("policy", "builder", "snapshot", "scheduler", "nodeagent")
"""DSec services ``dsec up`` starts, each as ``python -m dsec_<name>``."""

MAX_NODES = 3
"""``dsec up --nodes`` accepts 1..MAX_NODES. Each node is one more NATS server of the cluster and
one more node agent (~220 MiB RSS together, ~110 MiB PSS): three keep the embedded stack within
its 1.5 GiB budget (measured: 1.37 GiB RSS, 0.82 GiB PSS). More machines join as real nodes
(README, "Running on many machines")."""

NODE_AGENT = "nodeagent"
NODE_UID_SPAN = 60_000
"""Sandbox uids of co-located node agents: node ``k`` gets ``[200000 + (k-1)·span, +span)``, so
no two sandboxes of one machine share a uid (file permissions, signals, audit attribution)."""

POSTGRES_USER = "dsec"
POSTGRES_DB = "dsec"
POSTGRES_READ_ROLE = "dsec_reader"  # = dsec_core.projections.READ_ROLE (SELECT on read models)


class State(StrEnum):
    """What ``dsec status`` says about one server or service."""

    RUNNING = "running"
    STOPPED = "stopped"
    EXTERNAL = "external"
    UNHEALTHY = "unhealthy"
    ABSENT = "absent"


HEALTHY_STATES = frozenset({State.RUNNING, State.EXTERNAL, State.ABSENT})


class ServerRecord(BaseModel):
    """One server in ``stack.json``.

    ``credentials`` keeps the secrets an embedded server was created with (its Postgres password
    cannot change once ``initdb`` ran), so switching a server to external and back keeps working.
    """

    model_config = ConfigDict(extra="ignore")

    pid: int | None = None
    create_time: float | None = None
    endpoint: str | None = None
    version: str | None = None
    external: bool = False
    absent: bool = False
    ports: list[int] = Field(default_factory=list)
    listening: list[int] = Field(
        default_factory=list,
        description="Every port it listens on: ``ports`` and the ones derived from them "
        "(SeaweedFS's gRPC at +10000, OpenBao's cluster port at +1); sandboxes are denied all",
    )
    credentials: dict[str, str] = Field(default_factory=dict, repr=False)


class ServiceRecord(BaseModel):
    """One DSec service process in ``stack.json``."""

    model_config = ConfigDict(extra="ignore")

    pid: int | None = None
    create_time: float | None = None
    metrics_port: int
    module: str = ""


class StackState(BaseModel):
    """The content of ``$DSEC_HOME/stack.json`` (mode 0600: it holds secrets).

    The top-level keys are what :class:`dsec_core.settings.Settings` reads; keep them stable.
    """

    model_config = ConfigDict(extra="ignore")

    nats_url: str | None = None
    postgres_dsn: str | None = Field(default=None, repr=False)
    postgres_read_dsn: str | None = Field(default=None, repr=False)
    s3_endpoint: str | None = None
    s3_access_key: str | None = Field(default=None, repr=False)
    s3_secret_key: str | None = Field(default=None, repr=False)
    vault_addr: str | None = None
    vault_token: str | None = Field(default=None, repr=False)
    prometheus_url: str | None = None
    nodes: int = 1
    servers: dict[str, ServerRecord] = Field(default_factory=dict)
    services: dict[str, ServiceRecord] = Field(default_factory=dict)

    def to_json(self) -> str:
        """Serialise in the documented layout (top-level keys exactly as Settings expects)."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=False) + "\n"


def parse_state(text: str, source: str) -> StackState:
    """Parse ``stack.json`` text, naming the file and the bad field on error.

    Raises:
        StackStateError: the text is not JSON or a field has the wrong type.
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StackStateError(
            f"{source}: not valid JSON (line {exc.lineno}: {exc.msg}); "
            "fix or delete it (dsec up writes a new one)"
        ) from None
    if not isinstance(raw, dict):
        raise StackStateError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    try:
        return StackState.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise StackStateError(f"{source}: field {where!r}: {first['msg']}") from None


def postgres_dsn(
    password: str, port: int, host: str = "127.0.0.1", *, user: str = POSTGRES_USER
) -> str:
    """DSN of the embedded Postgres (TCP, password auth, database ``dsec``; user ``dsec``, or
    the read-only :data:`POSTGRES_READ_ROLE`)."""
    return f"postgresql://{user}:{password}@{host}:{port}/{POSTGRES_DB}"


def redact_url(url: str, *, user_is_secret: bool = False) -> str:
    """Drop the password from a URL/DSN so it can be shown (``user:pw@`` becomes ``user@``).

    ``user_is_secret`` drops the whole ``user@`` part too: in a NATS URL a lone user is a token.
    """
    parts = urlsplit(url)
    if parts.password is None and not (user_is_secret and parts.username):
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username}@{host}" if parts.username and not user_is_secret else host
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class ExternalEndpoints(BaseModel):
    """Servers the user pointed at through ``DSEC_*`` settings; ``dsec up`` does not start them."""

    model_config = ConfigDict(frozen=True)

    nats_url: str | None = None
    postgres_dsn: str | None = Field(default=None, repr=False)
    s3_endpoint: str | None = None
    s3_access_key: str | None = Field(default=None, repr=False)
    s3_secret_key: str | None = Field(default=None, repr=False)
    s3_secure: bool = False
    vault_addr: str | None = None
    vault_token: str | None = Field(default=None, repr=False)

    def names(self) -> frozenset[str]:
        """Names of the servers that are external."""
        present = {
            "nats": self.nats_url,
            "postgres": self.postgres_dsn,
            "s3": self.s3_endpoint,
            "vault": self.vault_addr,
        }
        return frozenset(name for name, value in present.items() if value)


def external_endpoints(values: Mapping[str, Any]) -> ExternalEndpoints:
    """Validate the external endpoints given as settings (keys as Settings field names).

    Raises:
        StackConfigError: an endpoint is malformed or lacks the credentials it needs; the message
            names the ``DSEC_*`` variable and what is valid.
    """
    ext = ExternalEndpoints(
        nats_url=values.get("nats_url") or None,
        postgres_dsn=values.get("postgres_dsn") or None,
        s3_endpoint=values.get("s3_endpoint") or None,
        s3_access_key=values.get("s3_access_key") or None,
        s3_secret_key=values.get("s3_secret_key") or None,
        s3_secure=bool(values.get("s3_secure", False)),
        vault_addr=values.get("vault_addr") or None,
        vault_token=values.get("vault_token") or None,
    )
    if ext.nats_url and urlsplit(ext.nats_url.split(",")[0]).scheme not in ("nats", "tls"):
        raise StackConfigError(
            f"DSEC_NATS_URL={ext.nats_url!r}: expected nats://HOST:PORT (or tls://HOST:PORT)"
        )
    if ext.postgres_dsn and urlsplit(ext.postgres_dsn).scheme not in ("postgresql", "postgres"):
        raise StackConfigError(
            f"DSEC_POSTGRES_DSN={redact_url(ext.postgres_dsn)!r}: expected "
            "postgresql://USER:PASSWORD@HOST:PORT/DB"
        )
    if ext.s3_endpoint:
        if "://" in ext.s3_endpoint or "/" in ext.s3_endpoint:
            raise StackConfigError(
                f"DSEC_S3_ENDPOINT={ext.s3_endpoint!r}: expected HOST:PORT without scheme or path "
                "(set DSEC_S3_SECURE=true for TLS)"
            )
        missing = [
            var
            for var, val in (
                ("DSEC_S3_ACCESS_KEY", ext.s3_access_key),
                ("DSEC_S3_SECRET_KEY", ext.s3_secret_key),
            )
            if not val
        ]
        if missing:
            raise StackConfigError(
                f"DSEC_S3_ENDPOINT is set but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not: an external S3 needs both keys"
            )
    if ext.vault_addr:
        if urlsplit(ext.vault_addr).scheme not in ("http", "https"):
            raise StackConfigError(
                f"DSEC_VAULT_ADDR={ext.vault_addr!r}: expected http(s)://HOST:PORT"
            )
        if not ext.vault_token:
            raise StackConfigError(
                "DSEC_VAULT_ADDR is set but DSEC_VAULT_TOKEN is not: "
                "an external Vault needs a token"
            )
    return ext


def validate_service_names(names: Iterable[str]) -> tuple[str, ...]:
    """Check service names (``[a-z][a-z0-9_]*``, unique) and return them in order.

    Raises:
        StackConfigError: a name is not a valid module suffix or is repeated.
    """
    seen: list[str] = []
    for name in names:
        if (
            not name
            or not name[0].isalpha()
            or not all(c.isdigit() or c == "_" or ("a" <= c <= "z") for c in name)
        ):
            raise StackConfigError(
                f"service {name!r}: expected a lowercase name like 'policy' "
                "(letters, digits, '_'; it runs as python -m dsec_<name>)"
            )
        if name in seen:
            raise StackConfigError(f"service {name!r} is listed twice")
        seen.append(name)
    return tuple(seen)


def service_environment(
    state: StackState,
    *,
    home: str,
    metrics_port: int,
    bucket: str | None = None,
    nats_seed: str | None = None,
) -> dict[str, str]:
    """The ``DSEC_*`` variables a service process gets so it reaches every server of the stack
    (``nats_seed``: the file of its own NATS identity, ``DSEC_NATS_NKEY_SEED``)."""
    env = {
        "DSEC_HOME": home,
        "DSEC_METRICS_PORT": str(metrics_port),
        # The embedded stack's endpoints stay on loopback (it checks them there), whatever the
        # operator's shell says; containers set DSEC_METRICS_HOST=0.0.0.0 themselves.
        "DSEC_METRICS_HOST": "127.0.0.1",
    }
    if nats_seed:
        env["DSEC_NATS_NKEY_SEED"] = nats_seed
    pairs = {
        "DSEC_NATS_URL": state.nats_url,
        "DSEC_POSTGRES_DSN": state.postgres_dsn,
        "DSEC_S3_ENDPOINT": state.s3_endpoint,
        "DSEC_S3_ACCESS_KEY": state.s3_access_key,
        "DSEC_S3_SECRET_KEY": state.s3_secret_key,
        "DSEC_VAULT_ADDR": state.vault_addr,
        "DSEC_VAULT_TOKEN": state.vault_token,
        "DSEC_S3_BUCKET": bucket,
    }
    env.update({key: value for key, value in pairs.items() if value})
    return env


def check_nodes(nodes: int) -> int:
    """Validate ``dsec up --nodes``.

    Raises:
        StackConfigError: not within 1..MAX_NODES.
    """
    if not 1 <= nodes <= MAX_NODES:
        raise StackConfigError(
            f"--nodes {nodes}: expected 1 to {MAX_NODES} nodes on one machine (more join as "
            "other machines: README, 'Running on many machines')"
        )
    return nodes


def replicas_for(nodes: int) -> int:
    """Copies of the event stream on an N-server NATS cluster: min(3, N)."""
    return min(3, nodes)


def node_id(index: int) -> str:
    """The node id of the ``index``-th (1-based) node of an embedded stack: ``node-<index>``."""
    return f"node-{index}"


def node_service_name(node: str) -> str:
    """Name of an extra node's node agent in ``stack.json`` and ``dsec status``
    (``nodeagent@node-2``)."""
    return f"{NODE_AGENT}@{node}"


def node_of_service(name: str) -> str | None:
    """The node of a service name made by :func:`node_service_name`, else ``None``."""
    base, sep, node = name.partition("@")
    return node if sep and base == NODE_AGENT and node else None


def server_kind(name: str) -> str:
    """The kind of a server name: ``nats-2`` is a ``nats``."""
    base, _, index = name.rpartition("-")
    return base if base and index.isdigit() else name


def server_order(name: str) -> tuple[int, int]:
    """Sort key of a server name: by kind (as :data:`SERVER_NAMES`), then member index."""
    kind = server_kind(name)
    index = int(name.rpartition("-")[2]) if kind != name else 1
    rank = SERVER_NAMES.index(kind) if kind in SERVER_NAMES else len(SERVER_NAMES)
    return rank, index


def node_environment(node: str) -> dict[str, str]:
    """What an extra node's agent gets besides the stack's endpoints: its node id and a uid
    range of its own (the DSEC_HOME, metrics port and NATS seed are set by the caller)."""
    index = int(node.rpartition("-")[2]) if node.rpartition("-")[2].isdigit() else 1
    return {
        "DSEC_NODE_ID": node,
        "DSEC_SANDBOX_UID_BASE": str(200_000 + (index - 1) * NODE_UID_SPAN),
    }


def status_exit_code(states: Iterable[State]) -> int:
    """Exit code of ``dsec status``: 0 when every component is healthy, 1 otherwise."""
    return 0 if all(state in HEALTHY_STATES for state in states) else 1


def render_prometheus_config(
    template: str,
    *,
    services: Mapping[str, int],
    prometheus_port: int,
    scrape_interval: str = "5s",
) -> str:
    """Render the Prometheus config template (``deploy/prometheus/prometheus.yml.tmpl``).

    Each DSec service becomes one static target labelled ``service=<name>``; the JSON the
    placeholders receive is valid YAML flow syntax.

    Raises:
        StackConfigError: the template names a placeholder that is not provided.
    """
    static_configs = [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"service": name}}
        for name, port in sorted(services.items())
    ]
    try:
        return Template(template).substitute(
            scrape_interval=scrape_interval,
            service_static_configs=json.dumps(static_configs),
            prometheus_target=json.dumps([f"127.0.0.1:{prometheus_port}"]),
        )
    except (KeyError, ValueError) as exc:
        raise StackConfigError(f"prometheus config template: unknown placeholder {exc}") from None
