"""The embedded stack: real servers plus the DSec services, under one home directory.

``dsec up``/``down``/``status`` and the ``dsec_testing`` fixtures both drive this class, so tests
run the servers exactly as users do.

Ports are chosen free on the first start and saved in ``stack.json``; later starts reuse them, so
endpoints and data (``<home>/data/<server>``) stay stable across ``down``/``up``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec_core import identity
from dsec_core.natsclient import credential_path
from dsec_core.retention import down_marker

from dsec_cli.stack import domain
from dsec_cli.stack.adapters import natsauth, probes
from dsec_cli.stack.adapters.procs import (
    allocate_ports,
    poll_until,
    port_holder,
    port_is_free,
    port_listening,
    process_ref,
    release_ports,
    run_parallel,
)
from dsec_cli.stack.adapters.servers import (
    SERVER_CLASSES,
    NatsClusterServer,
    NatsServer,
    PrometheusServer,
    S3Server,
    Server,
    nats_member_name,
)
from dsec_cli.stack.adapters.services import ServiceProcess, ServiceSpec
from dsec_cli.stack.adapters.statefile import load_state, locked, save_state, state_path
from dsec_cli.stack.domain import ExternalEndpoints, ServerRecord, ServiceRecord, StackState, State
from dsec_cli.stack.errors import (
    BinaryMissingError,
    PortInUseError,
    ServerStartError,
    ServiceFailed,
    StackConfigError,
    StackError,
    StartFailed,
    StopError,
)

ProgressFn = Callable[[str, str], None]
"""Called with (component name, what happens) while the stack starts or stops."""

_PORT_CONFLICT_MARKERS = ("address already in use", "not available", "bind:")
_START_ATTEMPTS = 3


def _noop(_name: str, _message: str) -> None:
    return None


@dataclass
class ComponentStatus:
    """One row of ``dsec status`` (no secrets)."""

    name: str
    kind: str  # "server" | "service"
    state: State
    endpoint: str | None = None
    version: str | None = None
    pid: int | None = None
    external: bool = False
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "endpoint": self.endpoint,
            "version": self.version,
            "pid": self.pid,
            "external": self.external,
            "detail": self.detail,
        }


@dataclass
class StackStatus:
    """Every server and service with its state."""

    home: Path
    servers: list[ComponentStatus] = field(default_factory=list)
    services: list[ComponentStatus] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.exit_code == 0

    @property
    def exit_code(self) -> int:
        """0 when all are healthy (running/external/absent), 1 otherwise."""
        return domain.status_exit_code(c.state for c in [*self.servers, *self.services])

    def to_dict(self) -> dict[str, Any]:
        return {
            "home": str(self.home),
            "healthy": self.healthy,
            "servers": {c.name: c.to_dict() for c in self.servers},
            "services": {c.name: c.to_dict() for c in self.services},
        }


@dataclass
class UpResult:
    """What ``up`` did: components it started (the rest already ran or are external)."""

    status: StackStatus
    started: list[str]
    elapsed_s: float


@dataclass
class DownResult:
    """What ``down`` stopped."""

    stopped: list[str]


class Stack:
    """The embedded stack under ``home``.

    Args:
        home: ``DSEC_HOME``; holds ``stack.json`` (0600), ``data/``, ``logs/``, ``run/``.
        external: servers the user runs elsewhere (never started here).
        services: the DSec services ``up`` starts (default :data:`domain.DEFAULT_SERVICES`);
            names or :class:`ServiceSpec` (to run another module).
        bucket: the S3 bucket created at start (setting ``s3_bucket``).
        s3_secure: use TLS to reach an external S3.
        binaries: per-server binary overrides (tests).
        with_prometheus: start Prometheus when its binary exists.
        server_timeout: seconds a server gets to become healthy.
        service_timeout: seconds a service gets to answer ``/healthz``.
        stop_timeout: seconds between the polite signal and SIGKILL on stop.
        die_with_parent: processes die with this one (test fixtures).
        python: interpreter that runs the services.
        nodes: nodes on this machine (``dsec up --nodes``): as many NATS servers in one
            JetStream cluster and, for nodes 2..N, a node agent each with its own home under
            ``<home>/nodes/<node id>``; ``None``: as recorded in ``stack.json`` (1 at first).
    """

    def __init__(
        self,
        home: Path,
        *,
        external: ExternalEndpoints | None = None,
        services: Sequence[str | ServiceSpec] | None = None,
        bucket: str = "dsec",
        s3_secure: bool = False,
        binaries: Mapping[str, Path] | None = None,
        with_prometheus: bool = True,
        server_timeout: float = 30.0,
        service_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        die_with_parent: bool = False,
        python: str = sys.executable,
        nodes: int | None = None,
    ) -> None:
        self.home = home.absolute()
        self.requested_nodes = None if nodes is None else domain.check_nodes(nodes)
        self.external = external or ExternalEndpoints()
        specs = [
            s if isinstance(s, ServiceSpec) else ServiceSpec(s)
            for s in (domain.DEFAULT_SERVICES if services is None else services)
        ]
        domain.validate_service_names(s.name for s in specs)
        self.service_specs = specs
        self.bucket = bucket
        self.s3_secure = s3_secure
        self.binaries = dict(binaries or {})
        self.with_prometheus = with_prometheus
        self.server_timeout = server_timeout
        self.service_timeout = service_timeout
        self.stop_timeout = stop_timeout
        self.die_with_parent = die_with_parent
        self.python = python
        self.state: StackState = load_state(self.home) or StackState()
        self._servers: dict[str, Server] = {}
        self._fresh_ports: set[str] = set()
        self._services: dict[str, ServiceProcess] = {}
        self._lock = threading.RLock()
        #: credentials/TLS for an external NATS (from the DSEC_NATS_* settings)
        self.external_nats_options: dict[str, Any] = {}

    @classmethod
    def from_settings(cls, settings: Any, **kwargs: Any) -> Stack:
        """Build from :class:`dsec_core.settings.Settings` (home, external endpoints, bucket).

        Raises:
            StackConfigError: an external endpoint is malformed or lacks credentials.
        """
        values = {name: getattr(settings, name, None) for name in ExternalEndpoints.model_fields}
        stack = cls(
            Path(settings.home),
            external=domain.external_endpoints(values),
            bucket=settings.s3_bucket,
            s3_secure=bool(settings.s3_secure),
            **kwargs,
        )
        if stack.external.nats_url:
            from dsec_core.natsclient import auth_options

            stack.external_nats_options = auth_options(settings)
        return stack

    def _adopt(self, state: StackState) -> None:
        """Take ``state`` (re-read from disk); keep cached process objects that still match it,
        so children this object spawned are reaped when they stop."""
        self.state = state
        for name, srv in list(self._servers.items()):
            rec = state.servers.get(name)
            if rec is None or srv.proc is None or rec.pid != srv.proc.pid or rec.ports != srv.ports:
                del self._servers[name]
        for name, svc in list(self._services.items()):
            srec = state.services.get(name)
            if srec is None or svc.proc is None or srec.pid != svc.proc.pid:
                del self._services[name]

    @property
    def state_file(self) -> Path:
        return state_path(self.home)

    def save(self) -> None:
        """Write ``stack.json`` (atomic, 0600)."""
        save_state(self.home, self.state)

    # --- servers -------------------------------------------------------------------------------

    @property
    def nodes(self) -> int:
        """Nodes of this stack on this machine (``--nodes``, else as recorded)."""
        return self.requested_nodes or self.state.nodes

    def nats_names(self) -> list[str]:
        """The embedded NATS servers: ``nats`` and, in a cluster, ``nats-2`` .. ``nats-N``."""
        return [nats_member_name(i) for i in range(1, self.nodes + 1)]

    def server_names(self) -> list[str]:
        """Servers ``up`` manages."""
        names = [*self.nats_names(), *domain.CORE_SERVERS[1:]]
        if self.with_prometheus:
            names.append("prometheus")
        return names

    def _member_ports(self) -> list[list[int]]:
        """Ports (client, monitor, cluster) of every NATS cluster member: recorded, or chosen
        now (and kept in memory until the members are recorded)."""
        out: list[list[int]] = []
        for name in self.nats_names():
            cached = self._servers.get(name)
            rec = self.state.servers.get(name)
            if cached is not None:
                out.append(list(cached.ports))
            elif rec is not None and len(rec.ports) == NatsClusterServer.port_count:
                out.append(list(rec.ports))
            else:
                ports = allocate_ports(NatsClusterServer.port_count)
                self._fresh_ports.add(name)
                self.state.servers[name] = ServerRecord(
                    ports=ports, credentials=rec.credentials if rec else {}
                )
                out.append(ports)
        return out

    def _nats_member(self, name: str) -> Server:
        members = self._member_ports()
        index = self.nats_names().index(name) + 1
        # Every member shares the first one's operator and route passwords.
        first = self.state.servers["nats"]  # recorded by _member_ports
        creds = {**NatsClusterServer.new_credentials(), **first.credentials}
        first.credentials = dict(creds)
        srv = NatsClusterServer(
            self.home,
            member=index,
            members=members,
            replicas=domain.replicas_for(self.nodes),
            ports=members[index - 1],
            credentials=creds,
            binary=self.binaries.get("nats"),
            die_with_parent=self.die_with_parent,
        )
        rec = self.state.servers.get(name)
        if rec is not None and not rec.external and rec.pid is not None:
            srv.proc = process_ref(rec.pid, rec.create_time)
        return srv

    def server(self, name: str) -> Server:
        """The server object for ``name``, built from ``stack.json`` (ports and credentials are
        allocated and generated the first time)."""
        with self._lock:
            if name in self._servers:
                return self._servers[name]
            if domain.server_kind(name) == "nats" and (self.nodes > 1 or name != "nats"):
                member = self._nats_member(name)
                self._servers[name] = member
                return member
            cls = SERVER_CLASSES[name]
            rec = self.state.servers.get(name)
            if rec is not None and len(rec.ports) == cls.port_count:
                ports = list(rec.ports)
            else:
                ports = allocate_ports(cls.port_count, cls.port_offsets)
                self._fresh_ports.add(name)
            creds = dict(rec.credentials) if rec and rec.credentials else cls.new_credentials()
            kwargs: dict[str, Any] = {
                "ports": ports,
                "credentials": creds,
                "binary": self.binaries.get(name),
                "die_with_parent": self.die_with_parent,
            }
            if cls is S3Server:
                kwargs["bucket"] = self.bucket
            if cls is PrometheusServer:
                kwargs["services"] = {n: r.metrics_port for n, r in self.state.services.items()}
            srv = cls(self.home, **kwargs)
            if rec is not None and not rec.external:
                srv.proc = process_ref(rec.pid, rec.create_time)
            self._servers[name] = srv
            return srv

    def _record_server(self, srv: Server, version: str | None) -> None:
        proc = srv.proc if srv.alive() else None
        self.state.servers[srv.name] = ServerRecord(
            pid=proc.pid if proc else None,
            create_time=proc.create_time if proc else None,
            endpoint=srv.endpoint,
            version=version,
            external=False,
            ports=srv.ports,
            listening=srv.all_ports(),
            credentials=srv.credentials,
        )
        for key, value in srv.client_settings().items():
            setattr(self.state, key, value)

    def _reallocate(self, srv: Server) -> None:
        release_ports(srv.ports, srv.port_offsets)
        srv.ports = allocate_ports(srv.port_count, srv.port_offsets)
        self._fresh_ports.add(srv.name)

    def _check_ports(self, srv: Server) -> None:
        """Fail early, naming server and port, when a saved port is held by another process."""
        for port in srv.all_ports():
            if port_is_free(port):
                continue
            if srv.name in self._fresh_ports:
                self._reallocate(srv)
                self._check_ports(srv)
                return
            holder = port_holder(port)
            by = f" by {holder}" if holder else ""
            raise PortInUseError(
                f"{srv.name}: port 127.0.0.1:{port} (saved in {self.state_file}) is in use{by}; "
                "stop that process, or delete the server's ports from stack.json to pick new ones"
            )

    def ensure_servers(self, names: Iterable[str], progress: ProgressFn | None = None) -> list[str]:
        """Make sure each named server runs and is healthy (external ones are only probed).

        Nothing this call started keeps running when it fails.

        Returns:
            Names of the servers it started.

        Raises:
            BinaryMissingError: a required binary is not installed (nothing was started).
            PortInUseError: a saved port is taken by another process (nothing was started).
            StartFailed: servers did not become healthy (each reason and log tail inside).
        """
        say = progress or _noop
        wanted = list(dict.fromkeys(names))
        with self._lock:
            self._set_nodes()
            ext = self.external.names()
            to_start: list[Server] = []
            missing: list[BinaryMissingError] = []
            for name in wanted:
                if name in ext:
                    self._retire_embedded(name)
                    continue
                srv = self.server(name)
                if not srv.binary_available():
                    if name == "prometheus":
                        self._mark_absent(srv)
                        say(name, "absent (binary not installed)")
                        continue
                    try:
                        srv.binary  # noqa: B018
                    except BinaryMissingError as exc:
                        missing.append(exc)
                    continue
                to_start.append(srv)
            if missing:
                raise BinaryMissingError("; ".join(str(e) for e in missing))
            # External servers first: when one is unreachable nothing gets started.
            self._probe_externals([n for n in wanted if n in ext], say)
            running = [s for s in to_start if s.alive()]
            for srv in running:
                if isinstance(srv, PrometheusServer):
                    srv.prepare()  # re-render: service ports may have changed
            probed = run_parallel({s.name: s.probe for s in running})
            for srv in running:
                outcome = probed[srv.name]
                if isinstance(outcome, probes.ProbeError):
                    say(srv.name, "unhealthy, restarting")
                    srv.stop(self.stop_timeout)
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    self._record_server(srv, outcome)
                    say(srv.name, "already running")
                    to_start.remove(srv)
            for srv in to_start:
                self._check_ports(srv)
            self._start_servers(to_start, say)
            self.save()
            return [s.name for s in to_start]

    def _mark_absent(self, srv: Server) -> None:
        self.state.servers[srv.name] = ServerRecord(absent=True)
        if srv.name == "prometheus":
            self.state.prometheus_url = None

    def _retire_embedded(self, name: str) -> None:
        """A server that became external: stop the embedded one we started earlier, if any."""
        rec = self.state.servers.get(name)
        if rec is None or rec.external:
            return
        srv = self.server(name)
        if srv.alive():
            srv.stop(self.stop_timeout)

    def _start_servers(self, servers: list[Server], say: ProgressFn) -> None:
        if not servers:
            return
        pending = list(servers)
        started: list[Server] = []
        failures: dict[str, tuple[str, str]] = {}
        for attempt in range(1, _START_ATTEMPTS + 1):
            for srv in pending:
                say(srv.name, "starting")
            prepared = run_parallel({s.name: s.prepare for s in pending})
            spawned: list[Server] = []
            for srv in pending:
                outcome = prepared[srv.name]
                if isinstance(outcome, BaseException):
                    failures[srv.name] = _failure(srv, outcome)
                    continue
                try:
                    srv.spawn()
                except StackError as exc:
                    failures[srv.name] = (str(exc), "")
                    continue
                spawned.append(srv)
                self._record_server(srv, None)
            self.save()  # pids first: an interrupted start can still be cleaned by `down`
            deadline = time.monotonic() + self.server_timeout
            waited = run_parallel({s.name: _start_waiter(s, deadline, say) for s in spawned})
            retry: list[Server] = []
            for srv in spawned:
                result = waited[srv.name]
                if isinstance(result, BaseException):
                    srv.stop(self.stop_timeout)
                    reason, log_tail = _failure(srv, result)
                    conflict = any(m in log_tail.lower() for m in _PORT_CONFLICT_MARKERS)
                    if conflict and srv.name in self._fresh_ports and attempt < _START_ATTEMPTS:
                        # Another process took a freshly chosen port between check and bind.
                        self._reallocate(srv)
                        retry.append(srv)
                        say(srv.name, "port taken meanwhile, retrying on new ports")
                        continue
                    failures[srv.name] = (reason, log_tail)
                    self._record_server(srv, None)
                else:
                    started.append(srv)
                    self._record_server(srv, str(result))
            pending = retry
            if not pending:
                break
        if failures:
            for srv in started:
                srv.stop(self.stop_timeout)
                self._record_server(srv, None)
            self.save()
            raise StartFailed("server(s)", failures)

    def _probe_externals(self, names: list[str], say: ProgressFn) -> None:
        ext = self.external
        checks: dict[str, Callable[[], str]] = {}
        if "nats" in names and ext.nats_url:
            url = ext.nats_url
            checks["nats"] = lambda: probes.probe_nats(url)
        if "postgres" in names and ext.postgres_dsn:
            dsn = ext.postgres_dsn
            checks["postgres"] = lambda: probes.probe_postgres(dsn)
        if "s3" in names and ext.s3_endpoint and ext.s3_access_key and ext.s3_secret_key:
            ep, ak, sk = ext.s3_endpoint, ext.s3_access_key, ext.s3_secret_key

            def check_s3() -> str:
                probes.probe_s3(ep, ak, sk, secure=ext.s3_secure)
                return "unknown"  # S3 does not report a server version

            checks["s3"] = check_s3
        if "vault" in names and ext.vault_addr and ext.vault_token:
            addr, token = ext.vault_addr, ext.vault_token
            checks["vault"] = lambda: probes.probe_vault(addr, token)
        results = run_parallel(checks)
        failures: dict[str, tuple[str, str]] = {}
        for name, outcome in results.items():
            prev = self.state.servers.get(name)
            self.state.servers[name] = ServerRecord(
                endpoint=self._external_endpoint(name),
                version=None if isinstance(outcome, BaseException) else str(outcome),
                external=True,
                ports=list(prev.ports) if prev else [],
                credentials=dict(prev.credentials) if prev else {},
            )
            if isinstance(outcome, BaseException):
                failures[name] = (f"external server {self._external_endpoint(name)}: {outcome}", "")
            else:
                say(name, f"external ({self._external_endpoint(name)})")
        self.state.nats_url = ext.nats_url or self.state.nats_url
        if ext.postgres_dsn:
            self.state.postgres_dsn = ext.postgres_dsn
            self.state.postgres_read_dsn = None  # the operator's: DSEC_POSTGRES_READ_DSN
        if ext.s3_endpoint:
            self.state.s3_endpoint = ext.s3_endpoint
            self.state.s3_access_key = ext.s3_access_key
            self.state.s3_secret_key = ext.s3_secret_key
        if ext.vault_addr:
            self.state.vault_addr = ext.vault_addr
            self.state.vault_token = ext.vault_token
        if failures:
            self.save()
            raise StartFailed("external server(s)", failures)
        if "nats" in names and ext.nats_url and "nats" in results:
            self._external_stream(ext.nats_url, say)

    def _external_stream(self, url: str, say: ProgressFn) -> None:
        """Create or check ``DSEC_EVENTS`` on an external NATS with the configured credentials.
        Only an operator identity may; with another one the operator must have created it
        (services refuse to start on a missing or weakened stream)."""

        try:
            natsauth.create_stream(url, options=self.external_nats_options, timeout=5.0)
        except Exception as exc:
            say(
                "nats",
                f"stream DSEC_EVENTS not created or checked here ({exc}); the operator "
                "creates it: nats stream add --config deploy/nats/DSEC_EVENTS.json",
            )

    def _external_endpoint(self, name: str) -> str:
        ext = self.external
        value = {
            "nats": domain.redact_url(ext.nats_url, user_is_secret=True) if ext.nats_url else None,
            "postgres": domain.redact_url(ext.postgres_dsn) if ext.postgres_dsn else None,
            "s3": ext.s3_endpoint,
            "vault": ext.vault_addr,
        }.get(name)
        return value or ""

    def cluster_urls(self) -> list[str]:
        """Client URLs of every embedded NATS server (one for a single node)."""
        urls: list[str] = []
        for name in self.nats_names():
            srv = self.server(name)
            assert isinstance(srv, NatsServer)
            urls.append(srv.url)
        return urls

    def stop_server(self, name: str, *, sig: int | None = None) -> None:
        """Stop one embedded server (``sig`` overrides its polite signal, e.g. SIGKILL)."""
        with self._lock:
            srv = self.server(name)
            if sig == signal.SIGKILL and srv.proc is not None:
                srv.proc.signal_group(signal.SIGKILL)
                srv.proc.signal(signal.SIGKILL)
            srv.stop(self.stop_timeout)
            self._record_server(srv, self.state.servers.get(name, ServerRecord()).version)
            self.save()

    def restart_server(self, name: str, *, kill: bool = False, downtime: float = 0.0) -> None:
        """Stop a server (SIGKILL when ``kill``) and start it again on the same ports and data."""
        with self._lock:
            self.stop_server(name, sig=signal.SIGKILL if kill else None)
            srv = self.server(name)
            if downtime > 0:
                time.sleep(downtime)  # the caller asked for an outage of this length
            poll_until(
                lambda: all(port_is_free(p) for p in srv.all_ports()),
                time.monotonic() + self.stop_timeout,
            )
            self._fresh_ports.discard(name)
            self._start_servers([srv], _noop)
            self.save()

    # --- NATS identities -----------------------------------------------------------------------

    def nats_seed(self, identity: str) -> str | None:
        """The nkey seed file of ``identity`` on the embedded NATS (``None`` when NATS is
        external, or the identity has no credential there)."""
        if "nats" in self.external.names():
            return None
        path = credential_path(self.home, identity)
        return str(path) if path.is_file() else None

    def operator_nats_url(self) -> str:
        """The embedded NATS URL with the operator's credentials (all rights: stream
        management; never handed to services or the CLI)."""
        srv = self.server("nats")
        assert isinstance(srv, NatsServer)
        return srv.operator_url

    # --- services ------------------------------------------------------------------------------

    def _service_port(self, name: str) -> int:
        rec = self.state.services.get(name)
        if rec is not None:
            return rec.metrics_port
        port = allocate_ports(1)[0]
        self.state.services[name] = ServiceRecord(metrics_port=port)
        return port

    def node_home(self, node: str) -> Path:
        """``DSEC_HOME`` of an extra node of this machine: ``<home>/nodes/<node id>``."""
        return self.home / "nodes" / node

    def node_specs(self) -> list[ServiceSpec]:
        """The node agents of nodes 2..N (when the node agent is one of the services)."""
        if domain.NODE_AGENT not in {s.name for s in self.service_specs}:
            return []
        return [
            ServiceSpec(domain.node_service_name(domain.node_id(i)))
            for i in range(2, self.nodes + 1)
        ]

    def _service_home(self, spec: ServiceSpec) -> Path:
        node = domain.node_of_service(spec.name)
        return self.home if node is None else self.node_home(node)

    def _service_env(self, spec: ServiceSpec, port: int) -> dict[str, str]:
        node = domain.node_of_service(spec.name)
        nats_identity = spec.service if node is None else natsauth.node_identity(node)
        env = domain.service_environment(
            self.state,
            home=str(self._service_home(spec)),
            metrics_port=port,
            bucket=self.bucket,
            nats_seed=self.nats_seed(nats_identity),
        )
        if node is not None:
            env.update(domain.node_environment(node))
        return env

    def service(self, spec: str | ServiceSpec) -> ServiceProcess:
        """The process object of a service (built from ``stack.json``)."""
        spec = spec if isinstance(spec, ServiceSpec) else self._recorded_spec(spec)
        with self._lock:
            existing = self._services.get(spec.name)
            if existing is not None and existing.spec.module_name == spec.module_name:
                return existing
            port = self._service_port(spec.name)
            svc = ServiceProcess(
                spec,
                home=self._service_home(spec),
                metrics_port=port,
                env=self._service_env(spec, port),
                python=self.python,
                die_with_parent=self.die_with_parent,
            )
            rec = self.state.services.get(spec.name)
            if rec is not None and rec.module in ("", spec.module_name):
                svc.proc = process_ref(rec.pid, rec.create_time)
            self._services[spec.name] = svc
            return svc

    def _spec(self, name: str) -> ServiceSpec:
        for spec in self.service_specs:
            if spec.name == name:
                return spec
        return ServiceSpec(name)

    def _recorded_spec(self, name: str) -> ServiceSpec:
        rec = self.state.services.get(name)
        return ServiceSpec(name, rec.module) if rec is not None and rec.module else self._spec(name)

    def _record_service(self, svc: ServiceProcess) -> None:
        proc = svc.proc if svc.alive() else None
        self.state.services[svc.name] = ServiceRecord(
            pid=proc.pid if proc else None,
            create_time=proc.create_time if proc else None,
            metrics_port=svc.metrics_port,
            module=svc.spec.module_name,
        )

    def ensure_services(
        self,
        specs: Sequence[str | ServiceSpec] | None = None,
        progress: ProgressFn | None = None,
        *,
        extra_env: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Start each service that is not already healthy and wait for its ``/healthz``.

        A service that fails stays recorded (``dsec status`` shows it stopped/unhealthy).
        ``extra_env`` is added to (and may override) the environment of the services started
        now.

        Returns:
            Names of the services it started.

        Raises:
            StartFailed: services exited or stayed unhealthy (reasons and log tails inside).
        """
        say = progress or _noop
        requested = self.service_specs if specs is None else specs
        chosen = [self._spec(s) if isinstance(s, str) else s for s in requested]
        env_overrides = dict(extra_env or {})
        self.ensure_identities([s.name for s in chosen], env_overrides)
        for spec in chosen:
            self._service_home(spec).mkdir(parents=True, exist_ok=True)
        with self._lock:
            started: list[ServiceProcess] = []
            for spec in chosen:
                svc = self.service(spec)
                if svc.alive():
                    try:
                        svc.probe()
                    except probes.ProbeError:
                        say(spec.name, "unhealthy, restarting")
                        svc.stop(timeout=self.stop_timeout)
                    else:
                        say(spec.name, "already running")
                        continue
                if not port_is_free(svc.metrics_port):
                    svc.metrics_port = self._reallocate_service_port(spec.name)
                svc.env = {**self._service_env(spec, svc.metrics_port), **(extra_env or {})}
                say(spec.name, "starting")
                svc.spawn()
                self._record_service(svc)
                started.append(svc)
            self.save()
            deadline = time.monotonic() + self.service_timeout
            waited = run_parallel({s.name: _service_waiter(s, deadline, say) for s in started})
            failures: dict[str, tuple[str, str]] = {}
            for svc in started:
                outcome = waited[svc.name]
                if isinstance(outcome, ServiceFailed):
                    failures[svc.name] = (outcome.reason, outcome.log_tail)
                elif isinstance(outcome, BaseException):
                    failures[svc.name] = (str(outcome), "")
                self._record_service(svc)
            self.save()
            if failures:
                raise StartFailed("service(s)", failures)
            return [s.name for s in started]

    def ensure_identities(self, names: Sequence[str], env: Mapping[str, str]) -> None:
        """The operator root key and a certified key for each DSec service about to start.

        The root key stays under ``<home>/trust`` (the operator's); each service reads only its
        own key and certificate. A node agent's certificate names its node (``DSEC_NODE_ID``).
        """
        paths = identity.TrustPaths(self.home)
        root = identity.ensure_root(paths)
        for name in names:
            node_of = domain.node_of_service(name)
            if node_of is not None:
                self._ensure_node_home(root, node_of)
                continue
            if name in identity.SERVICE_ROLES:
                node = None
                if name == "nodeagent":
                    node = env.get("DSEC_NODE_ID") or os.environ.get("DSEC_NODE_ID") or "node-1"
                identity.ensure_service_identity(paths, root, name, node_id=node)

    def _ensure_node_home(self, root: Any, node: str) -> None:
        """An extra node's home: the node agent's key and a certificate naming its node (as the
        operator gives a real second machine, ``dsec admin issue-service nodeagent --node``), the
        trust anchor, and ``stack.json`` (a link: the stack's endpoints, which its sandboxes may
        never reach)."""
        home = self.node_home(node)
        paths = identity.TrustPaths(home)
        identity.ensure_service_identity(paths, root, "nodeagent", node_id=node)
        public = identity.TrustPaths(self.home).anchor.read_text()
        if not paths.anchor.is_file() or paths.anchor.read_text() != public:
            paths.anchor.parent.mkdir(parents=True, exist_ok=True)
            paths.anchor.write_text(public)
        link = home / "stack.json"
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(self.state_file, home))

    def _reallocate_service_port(self, name: str) -> int:
        port = allocate_ports(1)[0]
        rec = self.state.services.get(name)
        self.state.services[name] = ServiceRecord(
            metrics_port=port, module=rec.module if rec else ""
        )
        return port

    def stop_service(self, name: str, *, sig: int = signal.SIGTERM) -> None:
        """Stop one service (SIGKILL: at once, no grace)."""
        with self._lock:
            svc = self.service(name)
            if sig == signal.SIGKILL:
                svc.kill()
            else:
                svc.stop(sig=sig, timeout=self.stop_timeout)
            self._record_service(svc)
            self.save()

    # --- whole stack ---------------------------------------------------------------------------

    def up(self, progress: ProgressFn | None = None) -> UpResult:
        """Start every server (in parallel), then every service; wait until all are healthy.

        Raises:
            BinaryMissingError, PortInUseError, StartFailed: see :meth:`ensure_servers` and
                :meth:`ensure_services`. Servers that started stay up when a service fails.
        """
        t0 = time.monotonic()
        with locked(self.home):
            self._adopt(load_state(self.home) or self.state)
            self._set_nodes()
            self._prune_services()
            for spec in self.service_specs:
                self._service_port(spec.name)
            started = self.ensure_servers(self.server_names(), progress)
            if "nats" not in started and "nats" not in self.external.names():
                # NATS was already running: as the operator, repair a stream weakened meanwhile
                # (a fresh start did this already), before services check it.
                self.server("nats").after_ready()
            if "postgres" not in started and "postgres" not in self.external.names():
                self.server("postgres").after_ready()  # (the read-only role of a newer dsec)
            started += self.ensure_services([*self.service_specs, *self.node_specs()], progress)
            elapsed = time.monotonic() - t0
        return UpResult(status=self.status(), started=started, elapsed_s=elapsed)

    def _set_nodes(self) -> None:
        """Apply ``--nodes`` (without it: as recorded). The number of nodes of a home is fixed
        once its NATS store holds the event log: NATS does not move a single server's streams
        into a cluster (or back), so another number would start on an empty log.

        Raises:
            StackConfigError: the stack runs with another number of nodes, or its log was
                written with another number.
        """
        wanted = self.requested_nodes
        if wanted is None or wanted == self.state.nodes:
            return
        running = [
            n
            for n, rec in self.state.servers.items()
            if domain.server_kind(n) == "nats"
            and not rec.external
            and (ref := process_ref(rec.pid, rec.create_time)) is not None
            and ref.alive()
        ]
        if running:
            raise StackConfigError(
                f"the stack runs with {self.state.nodes} node(s); run `dsec down` before "
                f"`dsec up --nodes {wanted}`"
            )
        store = self.home / "data" / "nats" / "jetstream"
        if store.is_dir() and any(store.iterdir()):
            raise StackConfigError(
                f"--nodes {wanted}: the event log in {store} was written by a stack of "
                f"{self.state.nodes} node(s), and NATS does not carry a log over to another "
                f"number of servers; keep --nodes {self.state.nodes}, or use another DSEC_HOME"
            )
        if "nats" in self.external.names() and wanted > 1:
            raise StackConfigError(
                f"--nodes {wanted}: DSEC_NATS_URL points at an external NATS; the extra nodes of "
                "one machine need the embedded NATS cluster (unset DSEC_NATS_URL)"
            )
        self.state.nodes = wanted
        self._servers.clear()
        keep = set(self.nats_names())
        for name in list(self.state.servers):
            if domain.server_kind(name) == "nats" and name not in keep:
                del self.state.servers[name]

    def _prune_services(self) -> None:
        """Forget services that are neither requested nor running (e.g. after ``--no-services``),
        so ``status`` reflects the stack that was asked for."""
        wanted = {s.name for s in [*self.service_specs, *self.node_specs()]}
        for name in list(self.state.services):
            if name not in wanted and not self.service(self._recorded_spec(name)).alive():
                del self.state.services[name]
                self._services.pop(name, None)

    def down(
        self, progress: ProgressFn | None = None, *, keep_sandboxes: bool = False
    ) -> DownResult:
        """Stop services, then servers; verify no process and no listening port remains.

        Idempotent: stopping a stopped stack does nothing. Unless ``keep_sandboxes``, the node
        agent stops its sandboxes first (see :func:`dsec_core.retention.down_marker`).

        Raises:
            StopError: something is still running or listening (names it).
        """
        say = progress or _noop
        with locked(self.home), self._lock:
            loaded = load_state(self.home)
            if loaded is None:
                return DownResult(stopped=[])
            self._adopt(loaded)
            stopped: list[str] = []
            ports: dict[int, str] = {}
            svcs = [self.service(self._recorded_spec(n)) for n in self.state.services]
            svcs = [s for s in svcs if s.alive()]
            for svc in svcs:
                say(svc.name, "stopping")
                ports[svc.metrics_port] = svc.name
            markers = [down_marker(self.home)] + [
                down_marker(svc.home) for svc in svcs if domain.node_of_service(svc.name)
            ]
            if not keep_sandboxes:
                for marker in markers:
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    marker.write_text("stop sandboxes\n")
            try:
                run_parallel({s.name: _stopper(s.stop, self.stop_timeout) for s in svcs})
            finally:
                for marker in markers:
                    marker.unlink(missing_ok=True)
            for svc in svcs:
                self._record_service(svc)
                stopped.append(svc.name)
            srvs = [
                self.server(name)
                for name, rec in self.state.servers.items()
                if not rec.external
                and not rec.absent
                and domain.server_kind(name) in SERVER_CLASSES
            ]
            srvs = [s for s in srvs if s.alive()]
            for srv in srvs:
                say(srv.name, "stopping")
                ports.update({p: srv.name for p in srv.all_ports()})
            run_parallel({s.name: _stopper(s.stop, self.stop_timeout) for s in srvs})
            for srv in srvs:
                self._record_server(srv, self.state.servers[srv.name].version)
                stopped.append(srv.name)
            self.save()
            self._verify_stopped(svcs, srvs, ports)
            return DownResult(stopped=stopped)

    def _verify_stopped(
        self, svcs: list[ServiceProcess], srvs: list[Server], ports: dict[int, str]
    ) -> None:
        deadline = time.monotonic() + 5.0
        poll_until(lambda: not any(port_listening(p) for p in ports), deadline)
        procs = [(s.name, s.proc) for s in svcs] + [(s.name, s.proc) for s in srvs]
        leftovers = [f"{name} (pid {p.pid})" for name, p in procs if p is not None and p.alive()]
        listening = [f"{name} port {p}" for p, name in sorted(ports.items()) if port_listening(p)]
        if leftovers or listening:
            raise StopError("still running after stop: " + ", ".join(leftovers + listening))

    def status(self) -> StackStatus:
        """Probe every recorded server and service (in parallel).

        Raises:
            StackError: the stack was never started here (no ``stack.json``).
        """
        loaded = load_state(self.home)
        if loaded is None:
            raise NeverStarted(
                f"the stack was never started in {self.home} (no stack.json); run: dsec up"
            )
        with self._lock:
            self._adopt(loaded)
            checks: dict[str, Callable[[], ComponentStatus]] = {}
            for name, rec in self.state.servers.items():
                if domain.server_kind(name) in domain.SERVER_NAMES:
                    checks[f"server:{name}"] = self._server_checker(name, rec)
            for name, srec in self.state.services.items():
                checks[f"service:{name}"] = self._service_checker(name, srec)
        results = run_parallel(checks)
        report = StackStatus(home=self.home)
        for key, outcome in results.items():
            kind, name = key.split(":", 1)
            row = (
                outcome
                if isinstance(outcome, ComponentStatus)
                else ComponentStatus(name, kind, State.UNHEALTHY, detail=str(outcome))
            )
            (report.servers if kind == "server" else report.services).append(row)
        report.servers.sort(key=lambda c: domain.server_order(c.name))
        svc_order = {n: i for i, n in enumerate(self.state.services)}
        report.services.sort(key=lambda c: svc_order.get(c.name, 99))
        return report

    def _server_checker(self, name: str, rec: ServerRecord) -> Callable[[], ComponentStatus]:
        def check() -> ComponentStatus:
            row = ComponentStatus(
                name,
                "server",
                State.STOPPED,
                endpoint=rec.endpoint,
                version=rec.version,
                external=rec.external,
            )
            if rec.absent:
                row.state = State.ABSENT
                row.detail = "binary not installed"
                return row
            try:
                if rec.external:
                    row.version = self._probe_external(name) or rec.version
                    row.state = State.EXTERNAL
                    return row
                srv = self.server(name)
                if not srv.alive():
                    return row
                row.pid = srv.proc.pid if srv.proc else None
                row.version = srv.probe()
                row.state = State.RUNNING
            except probes.ProbeError as exc:
                row.state = State.UNHEALTHY
                row.detail = str(exc)
            return row

        return check

    def _probe_external(self, name: str) -> str | None:
        st = self.state
        if name == "nats" and st.nats_url:
            return probes.probe_nats(st.nats_url)
        if name == "postgres" and st.postgres_dsn:
            return probes.probe_postgres(st.postgres_dsn)
        if name == "s3" and st.s3_endpoint and st.s3_access_key and st.s3_secret_key:
            probes.probe_s3(
                st.s3_endpoint, st.s3_access_key, st.s3_secret_key, secure=self.s3_secure
            )
            return None
        if name == "vault" and st.vault_addr and st.vault_token:
            return probes.probe_vault(st.vault_addr, st.vault_token)
        raise probes.ProbeError("no endpoint recorded")

    def _service_checker(self, name: str, rec: ServiceRecord) -> Callable[[], ComponentStatus]:
        def check() -> ComponentStatus:
            svc = self.service(self._recorded_spec(name))
            row = ComponentStatus(name, "service", State.STOPPED, endpoint=svc.url)
            if not svc.alive():
                return row
            row.pid = svc.proc.pid if svc.proc else None
            try:
                row.version = svc.probe()
                row.state = State.RUNNING
            except probes.ProbeError as exc:
                row.state = State.UNHEALTHY
                row.detail = str(exc)
            return row

        return check

    def rss(self) -> dict[str, int]:
        """Resident memory (bytes, process tree) of each running server and service."""
        out: dict[str, int] = {}
        with self._lock:
            for name, rec in self.state.servers.items():
                ref = process_ref(rec.pid, rec.create_time)
                if ref is not None and ref.alive():
                    out[name] = ref.rss_bytes()
            for name, srec in self.state.services.items():
                ref = process_ref(srec.pid, srec.create_time)
                if ref is not None and ref.alive():
                    out[name] = ref.rss_bytes()
        return out


class NeverStarted(StackError):
    """``dsec status`` on a home without ``stack.json``."""


def _failure(srv: Server, exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, ServerStartError):
        return exc.reason, exc.log_tail
    return f"{exc.__class__.__name__}: {exc}", ""


def _start_waiter(srv: Server, deadline: float, say: ProgressFn) -> Callable[[], str]:
    def wait() -> str:
        version = srv.wait_ready(deadline)
        srv.after_ready()
        say(srv.name, f"healthy ({srv.endpoint})")
        return version

    return wait


def _service_waiter(svc: ServiceProcess, deadline: float, say: ProgressFn) -> Callable[[], str]:
    def wait() -> str:
        version = svc.wait_healthy(deadline)
        say(svc.name, f"healthy ({svc.url})")
        return version

    return wait


def _stopper(stop: Callable[..., bool], timeout: float) -> Callable[[], bool]:
    return lambda: stop(timeout=timeout)
