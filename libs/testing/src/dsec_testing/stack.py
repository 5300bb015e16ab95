"""Test-side handles on the embedded stack: the same :class:`dsec_cli.stack.Stack` that
``dsec up`` drives, on free ports in a temporary home, servers started lazily one by one."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec_cli.stack import CORE_SERVERS, ServiceProcess, ServiceSpec, Stack, StartFailed, domain
from dsec_core.natsclient import DEFAULT_USER_IDENTITY
from dsec_core.retention import down_marker

if TYPE_CHECKING:
    import hvac
    import minio


@dataclass(frozen=True)
class S3Info:
    """Endpoint and credentials of the test S3 server (SeaweedFS)."""

    endpoint: str
    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    bucket: str
    secure: bool = False

    def settings(self) -> dict[str, Any]:
        """The ``Settings`` fields (``DSEC_S3_*``) that point a service at this server."""
        return {
            "s3_endpoint": self.endpoint,
            "s3_access_key": self.access_key,
            "s3_secret_key": self.secret_key,
            "s3_bucket": self.bucket,
        }

    def client(self) -> minio.Minio:
        """A MinIO SDK client with these credentials (no retries: failures show at once)."""
        from dsec_cli.stack.adapters.probes import minio_client

        return minio_client(self.endpoint, self.access_key, self.secret_key, secure=self.secure)


@dataclass(frozen=True)
class VaultInfo:
    """Address and root token of the test OpenBao (dev mode, in memory)."""

    addr: str
    token: str = field(repr=False)

    def settings(self) -> dict[str, Any]:
        """The ``Settings`` fields (``DSEC_VAULT_*``) that point a service at this server."""
        return {"vault_addr": self.addr, "vault_token": self.token}

    def client(self) -> hvac.Client:
        """An authenticated hvac client."""
        from dsec_cli.stack.adapters.probes import vault_client

        return vault_client(self.addr, self.token)


class StackFixture:
    """One embedded stack per test session, under ``home``.

    Servers start on first use (:meth:`ensure`) and die with the test process even when it is
    killed (PR_SET_PDEATHSIG). :meth:`close` stops everything.
    """

    def __init__(self, home: Path, *, bucket: str = "dsec", nodes: int = 1) -> None:
        self.home = home
        self.stack = Stack(
            home,
            services=[],
            bucket=bucket,
            with_prometheus=False,
            die_with_parent=True,
            server_timeout=60.0,
            service_timeout=60.0,
            stop_timeout=10.0,
            nodes=nodes,
        )

    def ensure(self, *names: str) -> None:
        """Start the named servers (in parallel) unless they run already (``nats``: every
        member of the NATS cluster)."""
        wanted = [m for n in names for m in (self.stack.nats_names() if n == "nats" else [n])]
        try:
            self.stack.ensure_servers(wanted)
        except StartFailed as exc:
            # The CLI prints each server's log tail beside the error; a test report shows only
            # the exception, so the tails go into it (else a failed start is undiagnosable).
            tails = "\n".join(
                f"--- {name}: {reason}\n{tail}" for name, (reason, tail) in exc.failures.items()
            )
            raise RuntimeError(f"{exc}\n{tails}") from exc

    @property
    def nats_url(self) -> str:
        """URL of the NATS server with the operator's credentials in it (all rights, like the
        admin of a deployment; started on first use). Services and the CLI get their own,
        restricted identities: :meth:`nats_seed`."""
        self.ensure("nats")
        return self.stack.operator_nats_url()

    @property
    def nats_plain_url(self) -> str:
        """URL of the NATS server without credentials."""
        self.ensure("nats")
        return _require(self.stack.state.nats_url, "nats_url")

    def nats_seed(self, identity: str) -> Path:
        """The nkey seed file of ``identity`` (a service name, or ``user-default``)."""
        self.ensure("nats")
        path = self.stack.nats_seed(identity)
        if path is None:
            raise RuntimeError(f"the test stack has no NATS identity {identity!r}")
        return Path(path)

    @property
    def postgres_dsn(self) -> str:
        """DSN of Postgres (started on first use)."""
        self.ensure("postgres")
        return _require(self.stack.state.postgres_dsn, "postgres_dsn")

    @property
    def s3(self) -> S3Info:
        """The S3 server (started on first use)."""
        self.ensure("s3")
        st = self.stack.state
        return S3Info(
            _require(st.s3_endpoint, "s3_endpoint"),
            _require(st.s3_access_key, "s3_access_key"),
            _require(st.s3_secret_key, "s3_secret_key"),
            self.stack.bucket,
        )

    @property
    def vault(self) -> VaultInfo:
        """OpenBao (started on first use)."""
        self.ensure("vault")
        st = self.stack.state
        return VaultInfo(
            _require(st.vault_addr, "vault_addr"), _require(st.vault_token, "vault_token")
        )

    def env(self) -> dict[str, str]:
        """``DSEC_*`` variables pointing at all four core servers (started if needed)."""
        self.ensure(*CORE_SERVERS)
        env = domain.service_environment(
            self.stack.state,
            home=str(self.home),
            metrics_port=0,
            bucket=self.stack.bucket,
            nats_seed=str(self.nats_seed(DEFAULT_USER_IDENTITY)),
        )
        del env["DSEC_METRICS_PORT"]
        env.update(self.trust_env())
        return env

    def trust_env(self) -> dict[str, str]:
        """The operator root (trust anchor) and a user credential of tenant ``default``, so a
        CLI with a home of its own signs as a certified user and verifies against the root."""
        from dsec_core import identity

        paths = identity.TrustPaths(self.home)
        root = identity.ensure_root(paths)
        cred = self.home / "identity" / "test-user.cred.json"
        if not cred.exists():
            key, cert = identity.issue_user(root, "tester", identity.DEFAULT_TENANT)
            cred.parent.mkdir(parents=True, exist_ok=True)
            cred.write_text(identity.credential_json(key, cert))
            cred.chmod(0o600)
        return {"DSEC_TRUST_ROOT": bytes(root.verify_key).hex(), "DSEC_CREDENTIAL": str(cred)}

    def restart_nats(
        self, *, kill: bool = False, downtime: float = 0.0, member: str = "nats"
    ) -> None:
        """Stop NATS (SIGKILL when ``kill``) and start it again on the same port and store
        (``member``: which server of a cluster)."""
        self.ensure("nats")
        self.stack.restart_server(member, kill=kill, downtime=downtime)

    def close(self) -> None:
        """Stop every service and server; raises when something keeps running."""
        self.stack.down()

    def discard(self) -> None:
        """:meth:`close` a stack whose home is thrown away next: the object store is killed
        instead of shut down, since nothing it holds is kept. SeaweedFS takes 1.2 s to shut
        down, and 10 s (then SIGKILL) when its HTTP server waits on a client's connection."""
        rec = self.stack.state.servers.get("s3")
        if rec is not None and not rec.external and not rec.absent:
            s3 = self.stack.server("s3")
            if s3.alive():
                s3.stop(timeout=0)
        self.close()


class ClusterFixture(StackFixture):
    """The embedded stack with ``nodes`` nodes on this machine (``dsec up --nodes``): as many
    NATS servers in one JetStream cluster (``DSEC_EVENTS`` on min(3, N) of them) and, on demand,
    node agents 2..N, each with its own home, certificate and uid range.

    The three NATS servers start in about a second (the other servers lazily, as usual).
    """

    def __init__(self, home: Path, *, nodes: int = 3, bucket: str = "dsec") -> None:
        super().__init__(home, bucket=bucket, nodes=nodes)
        self.nodes = nodes

    @property
    def member_names(self) -> list[str]:
        """The NATS servers: ``nats``, ``nats-2``, ..."""
        return self.stack.nats_names()

    @property
    def operator_urls(self) -> list[str]:
        """Every member's URL with the operator's credentials (a client given all of them
        fails over when one server dies)."""
        self.ensure("nats")
        from dsec_cli.stack.adapters.natsauth import operator_url

        password = self.stack.server("nats").credentials["operator_password"]
        return [operator_url(u, password) for u in self.stack.cluster_urls()]

    def member_of(self, server_name: str) -> str:
        """The member name (``nats-2``) of a NATS ``server_name`` (``dsec-nats-2``) as stream
        and cluster information report it."""
        name = server_name.removeprefix("dsec-")
        if name not in self.member_names:
            raise KeyError(f"{server_name!r} is not a server of this cluster")
        return name

    def kill_nats(self, member: str) -> None:
        """SIGKILL one NATS server (its store stays)."""
        self.stack.stop_server(member, sig=signal.SIGKILL)

    def start_nats(self, member: str) -> None:
        """Start a stopped NATS server again on its ports and store; returns once it is healthy
        (in a cluster: caught up with the meta group and its streams)."""
        self.stack.ensure_servers([member])

    def node_agents(self, count: int | None = None) -> list[ServiceSpec]:
        """The node agents of nodes 2..``count`` (default: every extra node)."""
        last = self.nodes if count is None else count
        return [
            ServiceSpec(domain.node_service_name(domain.node_id(i))) for i in range(2, last + 1)
        ]

    def node_home(self, node: str) -> Path:
        """``DSEC_HOME`` of an extra node (``<home>/nodes/<node>``)."""
        return self.stack.node_home(node)

    def start_node_agents(self, env: Mapping[str, str] | None = None) -> list[str]:
        """Start the node agent of every node (``nodeagent`` for node-1, ``nodeagent@node-k``),
        with the core servers; waits for each ``/healthz``. Returns the service names."""
        self.ensure(*CORE_SERVERS)
        specs = [ServiceSpec("nodeagent"), *self.node_agents()]
        self.stack.ensure_services(specs, extra_env=env)
        return [s.name for s in specs]


def _require(value: str | None, key: str) -> str:
    if not value:
        raise RuntimeError(f"the test stack recorded no {key} after starting its server")
    return value


class NatsRestarter:
    """Restart the session's NATS server on the same port and JetStream store.

    Call it (``nats_restart()``) from sync code, or ``await nats_restart.arestart()`` from an async
    test so publishers on the event loop keep running during the outage.
    """

    def __init__(self, fixture: StackFixture) -> None:
        self._fixture = fixture
        self.count = 0

    def __call__(self, *, kill: bool = False, downtime: float = 0.0) -> None:
        """Restart now; ``kill`` simulates a crash (SIGKILL), ``downtime`` keeps it down longer."""
        self._fixture.restart_nats(kill=kill, downtime=downtime)
        self.count += 1

    async def arestart(self, *, kill: bool = False, downtime: float = 0.0) -> None:
        """Like calling it, without blocking the event loop."""
        await asyncio.to_thread(self, kill=kill, downtime=downtime)


class ServiceRunner:
    """Start DSec services as processes against the session stack; stop, kill or restart one.

    Everything it started is stopped when the test ends.
    """

    def __init__(self, fixture: StackFixture) -> None:
        self._fixture = fixture
        self._started: dict[str, ServiceSpec] = {}
        self._env: dict[str, dict[str, str]] = {}

    def start(
        self,
        *names: str | ServiceSpec,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Start services (``"policy"`` runs ``python -m dsec_policy``) and wait for /healthz;
        a node agent brings the scheduler along (it places the sandboxes the node agent runs).

        Raises:
            dsec_cli.stack.StartFailed: a service exited or stayed unhealthy (log tail inside).
        """
        self._fixture.ensure(*CORE_SERVERS)
        specs = [n if isinstance(n, ServiceSpec) else ServiceSpec(n) for n in names]
        started = {*self._started, *(s.name for s in specs)}
        if "nodeagent" in started and "scheduler" not in started:
            # the pipeline runs through the scheduler: env.built -> sandbox.scheduled
            specs.insert(0, ServiceSpec("scheduler"))
        stack = self._fixture.stack
        for spec in specs:
            self._started[spec.name] = spec
            self._env[spec.name] = dict(env or {})
        default_timeout = stack.service_timeout
        if timeout is not None:
            stack.service_timeout = timeout
        try:
            stack.ensure_services(specs, extra_env=env)
        finally:
            stack.service_timeout = default_timeout

    def process(self, name: str) -> ServiceProcess:
        """The process handle of a started service."""
        return self._fixture.stack.service(self._started[name])

    def pid(self, name: str) -> int | None:
        """Pid of the running service, or ``None`` when it is not running."""
        return self.process(name).pid

    def url(self, name: str) -> str:
        """``http://127.0.0.1:<metrics port>`` of the service (``/metrics``, ``/healthz``)."""
        return self.process(name).url

    def log(self, name: str) -> str:
        """The service's log so far."""
        path = self.process(name).log_path
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, name: str) -> None:
        """SIGTERM (SIGKILL after the grace period)."""
        self._fixture.stack.stop_service(name, sig=signal.SIGTERM)

    def kill(self, name: str) -> None:
        """SIGKILL: a crash, with whatever it held unacknowledged."""
        self._fixture.stack.stop_service(name, sig=signal.SIGKILL)

    def restart(self, name: str, *, kill: bool = False) -> None:
        """Stop (or kill) and start again with the same environment; waits for /healthz."""
        if kill:
            self.kill(name)
        else:
            self.stop(name)
        self._fixture.stack.ensure_services([self._started[name]], extra_env=self._env[name])

    def close(self) -> None:
        """Stop every service this runner started. A node agent stops its sandboxes first (as
        under ``dsec down``): a test's sandboxes never outlive it as orphaned processes and
        cgroups (``stop``/``kill``/``restart`` leave them running, to be re-adopted)."""
        stack = self._fixture.stack
        for name in list(self._started):
            svc = stack.service(self._started[name])
            marker = None
            if (name == domain.NODE_AGENT or domain.node_of_service(name)) and svc.alive():
                marker = down_marker(svc.home)
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text("stop sandboxes\n")
            try:
                stack.stop_service(name)
            finally:
                if marker is not None:
                    marker.unlink(missing_ok=True)
        self._started.clear()
