"""DSec service processes: ``python -m dsec_<name>``, health at ``/healthz`` on its metrics port."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dsec_cli.stack.adapters import probes
from dsec_cli.stack.adapters.procs import ProcessRef, poll_until, spawn, stop_process, tail
from dsec_cli.stack.errors import ServiceFailed


@dataclass(frozen=True)
class ServiceSpec:
    """Which service to run and how.

    Attributes:
        name: the service name (``policy``; an extra node's agent ``nodeagent@node-2``); its log
            is ``<home>/logs/<service>.log`` (its own home for an extra node).
        module: the module run with ``python -m`` (default ``dsec_<service>``).
    """

    name: str
    module: str = ""

    @property
    def service(self) -> str:
        """What the process is (and answers on ``/healthz``): the name before ``@``."""
        return self.name.partition("@")[0]

    @property
    def module_name(self) -> str:
        return self.module or f"dsec_{self.service}"


def probe_service(name: str, port: int, timeout: float = 2.0) -> str:
    """``GET /healthz`` must answer 200 with ``{"status": "ok", "service": name, ...}``.

    Returns:
        The version the service reports.

    Raises:
        probes.ProbeError: not healthy, or another service answers on that port.
    """
    body = probes.http_get_json(f"http://127.0.0.1:{port}/healthz", timeout)
    if not isinstance(body, dict) or body.get("status") != "ok":
        raise probes.ProbeError(f"/healthz answered {body!r}, expected status 'ok'")
    answered = body.get("service")
    if answered is not None and answered != name:
        raise probes.ProbeError(f"port {port} is answered by service {answered!r}, not {name!r}")
    return str(body.get("version", "unknown"))


class ServiceProcess:
    """One running (or to-be-run) DSec service.

    Args:
        spec: what to run.
        home: the stack home (logs go to ``<home>/logs/<name>.log``).
        metrics_port: ``DSEC_METRICS_PORT`` for it.
        env: ``DSEC_*`` variables (added to the caller's environment).
        python: the interpreter (default: this one).
        die_with_parent: SIGTERM it when the creating process dies (tests).
    """

    def __init__(
        self,
        spec: ServiceSpec,
        *,
        home: Path,
        metrics_port: int,
        env: Mapping[str, str],
        python: str = sys.executable,
        die_with_parent: bool = False,
    ) -> None:
        self.spec = spec
        self.home = home.absolute()
        self.metrics_port = metrics_port
        self.env = dict(env)
        self.python = python
        self.die_with_parent = die_with_parent
        self.proc: ProcessRef | None = None
        self.version: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> Path:
        return self.home / "logs" / f"{self.spec.service}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def spawn(self) -> ProcessRef:
        """Start the process (returns at once)."""
        env = {**os.environ, **self.env}
        self.proc = spawn(
            [self.python, "-m", self.spec.module_name],
            log_path=self.log_path,
            env=env,
            cwd=self.home,
            die_with_parent=self.die_with_parent,
        )
        return self.proc

    def probe(self, timeout: float = 2.0) -> str:
        """One health check (see :func:`probe_service`)."""
        return probe_service(self.spec.service, self.metrics_port, timeout)

    def wait_healthy(self, deadline: float) -> str:
        """Poll ``/healthz`` until it is ok or the monotonic ``deadline``.

        Raises:
            ServiceFailed: the process exited or stayed unhealthy (message says which; the log's
                tail is in ``log_tail``).
        """
        last = "no answer yet"

        def ready() -> bool:
            nonlocal last
            if self.proc is not None and not self.proc.alive():
                return True
            try:
                self.version = self.probe(timeout=max(min(1.0, deadline - time.monotonic()), 0.1))
            except probes.ProbeError as exc:
                last = str(exc)
                return False
            return True

        ok = poll_until(ready, deadline)
        if self.proc is not None and not self.proc.alive():
            code = self.proc.returncode()
            status = f" with status {code}" if code is not None else ""
            raise ServiceFailed(self.name, f"exited{status}", tail(self.log_path))
        if not ok:
            raise ServiceFailed(
                self.name, f"not healthy before the deadline: {last}", tail(self.log_path)
            )
        return self.version or "unknown"

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.proc is not None and self.proc.alive()

    @property
    def pid(self) -> int | None:
        """Pid of the running process, or ``None``."""
        return self.proc.pid if self.proc is not None and self.proc.alive() else None

    def stop(self, *, sig: int = signal.SIGTERM, timeout: float = 10.0) -> bool:
        """Stop it (``sig``, SIGKILL after ``timeout``); True when gone."""
        if self.proc is None:
            return True
        return stop_process(self.proc, sig=sig, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL it now, without grace (crash tests)."""
        if self.proc is not None:
            self.proc.signal(signal.SIGKILL)
            self.proc.wait_gone(time.monotonic() + 5.0)
            stop_process(self.proc, timeout=1.0)
