"""The directories of one node, typed, with the one service that writes each.

No two services share a directory: a service writes only under the roots it owns here, and
nothing crosses machines except through the bus, the object store, Vault and Postgres. Every
path a service uses is spelled here, never in the service (``rg '"sandboxes"' services`` finds
nothing else).

=================================  ============  ===============================================
directory (under ``$DSEC_HOME``)   owner         what
=================================  ============  ===============================================
``sandboxes/<id>/``                nodeagent     a sandbox's code copy, logs, disk image, fs
``run/sandboxes/<id>/``            nodeagent     its runtime state (pid, cgroup, sockets)
``run/sandbox-root/``              nodeagent     empty: each sandbox's root view is mounted
                                                 there in the sandbox's own mount namespace
``envs/<lock hash>/``              nodeagent     environments staged from the object store
``cache/``                         nodeagent     S3 objects for sandboxes, runtimes, disk images,
                                                 stat caches of its sandboxes' snapshots
``tls-proxy/``                     nodeagent     the opt-in TLS proxy's CA and sockets
``builder/``                       builder       build work dirs, wheel cache, packed envs
``snapshot/``                      snapshot      the snapshot service's scratch space
``keys/``, ``identity/``           each service  its own key and certificate (one file each)
=================================  ============  ===============================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_LOCK = re.compile(r"^[A-Za-z0-9]{8,128}\Z")
_SANDBOX = re.compile(r"^[A-Za-z0-9_-]{1,128}\Z")


class LayoutError(ValueError):
    """A name that cannot be one directory of the layout (path traversal, separators...)."""


def _checked(value: str, pattern: re.Pattern[str], what: str) -> str:
    if not pattern.match(value):
        raise LayoutError(f"{what} {value!r} must match {pattern.pattern}")
    return value


@dataclass(frozen=True)
class SandboxDirs:
    """The directories of one sandbox on its node (written by the node agent only)."""

    root: Path
    run: Path

    @property
    def code(self) -> Path:
        """The sandbox's code copy (shown read-only at the spec's workdir)."""
        return self.root / "code"

    @property
    def logs(self) -> Path:
        """stdout/stderr files, kept after the sandbox exits."""
        return self.root / "logs"


@dataclass(frozen=True)
class NodeLayout:
    """Every directory of the node whose state lives in ``home``."""

    home: Path

    @classmethod
    def of(cls, home: Path) -> NodeLayout:
        """The layout of ``home`` (resolved once)."""
        return cls(home.resolve())

    # --- node agent ---------------------------------------------------------------------------

    @property
    def sandboxes(self) -> Path:
        return self.home / "sandboxes"

    @property
    def sandboxes_run(self) -> Path:
        return self.home / "run" / "sandboxes"

    @property
    def sandbox_root_mount(self) -> Path:
        """An empty directory where each sandbox's init, in a mount namespace of its own, mounts
        its root view before its plan names the sandbox (the node agent's pre-forked launcher)."""
        return self.home / "run" / "sandbox-root"

    def sandbox(self, sandbox_id: str) -> SandboxDirs:
        """One sandbox's directories (the id is checked: one path component)."""
        sid = _checked(sandbox_id, _SANDBOX, "sandbox id")
        return SandboxDirs(self.sandboxes / sid, self.sandboxes_run / sid)

    @property
    def envs(self) -> Path:
        """Environments this node staged (fetched, verified and unpacked from S3)."""
        return self.home / "envs"

    def env(self, lock_hash: str) -> Path:
        """The staged environment of one lock (a ``site-packages`` directory inside)."""
        return self.envs / _checked(lock_hash, _LOCK, "lock hash")

    def env_site_packages(self, lock_hash: str) -> Path:
        """What the sandbox gets on its ``PYTHONPATH`` (bound read-only)."""
        return self.env(lock_hash) / "site-packages"

    @property
    def cache(self) -> Path:
        """The node agent's caches (``s3/``, ``runtimes/``, ``disk-images/``)."""
        return self.home / "cache"

    @property
    def s3_cache(self) -> Path:
        return self.cache / "s3"

    @property
    def snapshot_cache(self) -> Path:
        """Stat caches that make snapshots of this node's sandboxes incremental."""
        return self.cache / "snapshots"

    @property
    def tls_proxy(self) -> Path:
        return self.home / "tls-proxy"

    @property
    def state(self) -> Path:
        """The state keeper's warm snapshots (``state/<tenant>/<group>/<agent>/warm-<seq>.bin``)."""
        return self.home / "state"

    # --- builder and snapshot service ---------------------------------------------------------

    @property
    def builder(self) -> Path:
        """The builder's private root (build dirs, wheel cache, packed archives)."""
        return self.home / "builder"

    @property
    def snapshot(self) -> Path:
        """The snapshot service's private scratch root."""
        return self.home / "snapshot"
