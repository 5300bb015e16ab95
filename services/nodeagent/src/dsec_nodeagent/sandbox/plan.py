"""Pure translation of a :class:`SandboxConfig` into the plan the pre-exec stage executes.

No I/O beyond ``os.path.exists`` on host paths named by the config: the root view's layout, the
Landlock sets and the workload's environment are decided here, so they can be unit-tested.
"""

from __future__ import annotations

import marshal
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec_core.spec.models import SANDBOX_OWNED_ENV

from dsec_nodeagent.sandbox.discovery import RuntimeView
from dsec_nodeagent.sandbox.init import DEV_NODES
from dsec_nodeagent.sandbox.models import SandboxConfig

ENV_TARGET = "/opt/dsec/env"
SEMANTIC_TARGET = "/opt/dsec/semantic"
USER_BASE_TARGET = "/opt/dsec/user"
"""The sandbox's ``PYTHONUSERBASE``: its user site-packages links to :data:`SEMANTIC_TARGET`."""
SDK_TARGET = "/opt/dsec/sdk"
SDK_DEPS_TARGET = "/opt/dsec/sdk-deps"
RUN_TARGET = "/run/dsec"
RULES_FILE = "rules.marshal"
"""The semantic layer's rules in a sandbox's run directory (:func:`encode_rules`)."""
RULES_TARGET = f"{RUN_TARGET}/{RULES_FILE}"
EVENTS_TARGET = f"{RUN_TARGET}/events.sock"
IPC_TARGET = f"{RUN_TARGET}/ipc"
IPC_SOCKET_NAME = "ipc.sock"
IPC_SOCKET_TARGET = f"{IPC_TARGET}/{IPC_SOCKET_NAME}"
DEV_WRITABLE = ("/dev/null", "/dev/zero", "/dev/full", "/dev/shm", "/dev/tty")
TMP_OPTIONS = "mode=1777"
TMP_BYTES_PER_INODE = 16 * 1024
"""A sandbox's ``/tmp`` holds at most its memory limit, in at most one file per 16 KiB of it
(a tmpfs's own default is half the host's RAM and an inode per page of that)."""


def tmp_options(memory_bytes: int | None) -> str:
    """The mount options of a sandbox's private ``/tmp``: bounded by its memory limit, so a
    sandbox filling it meets ENOSPC there, not the host's memory (where the memory cgroup does
    not account the kernel's inodes)."""
    if memory_bytes is None:
        return TMP_OPTIONS
    inodes = max(1024, memory_bytes // TMP_BYTES_PER_INODE)
    return f"{TMP_OPTIONS},size={memory_bytes},nr_inodes={inodes}"


class PlanError(ValueError):
    """The config cannot be laid out (overlapping mounts, a missing source); names the path."""


@dataclass(frozen=True)
class HostPaths:
    """Host-side locations of one sandbox, chosen by the manager.

    Attributes:
        root: empty directory the new root tmpfs is mounted on (inside the sandbox's mount ns).
        exit_path: where the supervisor writes ``exit.json``.
        data_dir: per-sandbox data (backing dirs of ``write_allowed`` paths).
        semantic_site: directory holding ``usercustomize.py`` of the semantic layer.
        rules_path: the sandbox's semantic rules file, or ``None``.
        events_socket: the node agent's datagram socket for semantic decisions, or ``None``.
        ipc_dir: a directory holding only a link to the IPC broker's socket (shown at
            ``/run/dsec/ipc``), or ``None``: no communication plane.
        sdk_packages: package directories (``dsec_sdk``) put first on the import path, so the
            SDK always speaks the protocol of this node's broker.
        sdk_fallbacks: package directories the SDK needs (``msgpack``), placed after the
            environment's own packages: a version the spec pinned wins.
    """

    root: Path
    exit_path: Path
    data_dir: Path
    semantic_site: Path
    rules_path: Path | None = None
    events_socket: Path | None = None
    ipc_dir: Path | None = None
    sdk_packages: tuple[Path, ...] = ()
    sdk_fallbacks: tuple[Path, ...] = ()


@dataclass(frozen=True)
class KernelFacts:
    """Host facts the child cannot read once confined (computed once per node agent)."""

    landlock_abi: int
    cap_last_cap: int
    seccomp_program: bytes
    cgroup_procs: list[str]


@dataclass
class PlanResult:
    """A plan plus what the manager must do on the host before running it.

    Attributes:
        plan: JSON-able dict for :mod:`.init` (holds secret values: pipe it, never store it).
        writable_dirs: host directories to create and hand to the sandbox uid.
        warnings: things the user should know (a mount nobody may read, a missing path).
    """

    plan: dict[str, Any]
    writable_dirs: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _depth(path: str) -> int:
    """``len(PurePosixPath(path).parts)``, without building the path object (every start sorts
    its layout by it)."""
    return sum(1 for part in path.split("/") if part and part != ".") + path.startswith("/")


def _ancestors(path: str) -> list[str]:
    """Every directory ``path`` lies strictly inside, ``/`` last ("/a/b/c": "/a/b", "/a", "/")."""
    found = []
    head = path.rstrip("/")
    while "/" in head:
        head = head.rsplit("/", 1)[0]
        found.append(head or "/")
    return found


def _slug(path: str) -> str:
    return path.strip("/").replace("/", "__") or "root"


def kept_dir(data_dir: Path, path: str) -> Path:
    """Where the host keeps a sandbox's writable ``path`` (a ``write_allowed`` path no mount
    covers and no ``write_sources`` entry places): inside its disk quota's filesystem while it
    runs, among its outputs after it ended."""
    return data_dir / "fs" / _slug(path)


def env_site_dir(env_dir: Path | None, version: str) -> str | None:
    """The sandbox path of the environment's site-packages directory."""
    if env_dir is None:
        return None
    nested = env_dir / "lib" / f"python{version}" / "site-packages"
    if nested.is_dir():
        return f"{ENV_TARGET}/lib/python{version}/site-packages"
    return ENV_TARGET


def build(
    config: SandboxConfig,
    runtime: RuntimeView,
    host: HostPaths,
    kernel: KernelFacts,
    uid: int,
) -> PlanResult:
    """Lay out the sandbox; raise :class:`PlanError` naming the offending path."""
    result = PlanResult(plan={})
    runtime_entries = _runtime_entries(runtime)
    site = {"kind": "symlink", "path": user_site(runtime.version), "target": SEMANTIC_TARGET}
    layout = [*runtime_entries, *_extra_entries(config, runtime_entries)]
    declared = _declared_entries(config, host, result)
    layout += declared
    system = _system_entries(host, uid, layout, config)
    layout += [*system, site]
    # What every sandbox of this runtime on this node shares (the node agent has the next
    # sandbox's init bind them while it plans it; init checks them against this plan's).
    semantic = [e for e in system if e["kind"] == "bind" and e["path"] == SEMANTIC_TARGET]
    shared = {id(entry) for entry in (*runtime_entries, *semantic, site)}
    _check_overlaps(layout)
    _check_provided(config, declared, [*runtime_entries, *system, site])
    layout.sort(key=lambda e: _depth(e["path"]))
    read, write = _landlock_sets(config, runtime, host, layout, result)
    for name in SANDBOX_OWNED_ENV:  # (a spec is refused them; a config made here is not)
        if name in config.env or name in config.secret_env:
            result.warnings.append(
                f"env {name}: ignored; the sandbox's Python loads DSec's user site "
                f"({USER_BASE_TARGET}), which adds the environment's packages and the "
                "semantic layer"
            )
    result.plan = {
        "sandbox_id": config.sandbox_id,
        "hostname": config.hostname or config.sandbox_id,
        "uid": uid,
        "gid": uid,
        "cgroup_procs": kernel.cgroup_procs,
        "unshare_net": not config.network,
        "root": str(host.root),
        "exit_path": str(host.exit_path),
        "layout": layout,
        "shared": [index for index, entry in enumerate(layout) if id(entry) in shared],
        "landlock": {
            "abi": kernel.landlock_abi,
            "read": read,
            "write": write,
            "tcp_connect_ports": config.tcp_connect_ports,
            # CRIU's parasite, run inside the workload, must reach the abstract socket CRIU
            # makes: a checkpointable sandbox has no abstract-socket scope (docs/migration.md)
            "scope_abstract_unix": not config.checkpointable,
        },
        "seccomp": kernel.seccomp_program.hex(),
        "cap_last_cap": kernel.cap_last_cap,
        "argv": _argv(config, runtime),
        "python": runtime.executable,
        "reaper_exec": config.checkpointable,
        "env": workload_env(config, runtime, host),
        "cwd": config.workdir,
        "nofile": config.limits.files,
        "log_bytes": config.limits.log_bytes,
        "stdout_path": str(host.data_dir / "logs" / "stdout.log"),
        "stderr_path": str(host.data_dir / "logs" / "stderr.log"),
    }
    return result


def _bind(src: Path | str, dst: str, ro: bool = True) -> dict[str, Any]:
    return {"kind": "bind", "src": str(src), "path": dst, "ro": ro}


def _runtime_entries(runtime: RuntimeView) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = [
        {"kind": "symlink", "path": p, "target": t} for p, t in runtime.symlinks
    ]
    entries += [_bind(d, d) for d in runtime.ro_dirs]
    entries += [_bind(f, f) for f in runtime.ro_files]
    return entries


def _extra_entries(config: SandboxConfig, runtime: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The config's ``extra_ro_paths`` that no bind of the ``runtime`` entries covers."""
    entries: list[dict[str, Any]] = []
    for extra in config.extra_ro_paths:
        resolved = str(extra.resolve())
        if not extra.exists():
            raise PlanError(f"extra_ro_paths: {extra} does not exist on this host")
        binds = (e for e in (*runtime, *entries) if e["kind"] == "bind")
        if not any(_under(resolved, e["path"]) for e in binds):
            entries.append(_bind(resolved, resolved))
        if str(extra) != resolved:
            entries.append({"kind": "symlink", "path": str(extra), "target": resolved})
    return entries


def _declared_entries(
    config: SandboxConfig, host: HostPaths, result: PlanResult
) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    if config.env_dir is not None:
        entries.append(_bind(_existing(config.env_dir, "env_dir"), ENV_TARGET))
    if config.code_dir is not None:
        entries.append(_bind(_existing(config.code_dir, "code_dir"), config.workdir))
    else:
        entries.append({"kind": "dir", "path": config.workdir})
    for mount in config.mounts:
        entries.append(
            _bind(_existing(mount.source, f"mount {mount.target}"), mount.target, mount.read_only)
        )
    writable = [e["path"] for e in entries if e["kind"] == "bind" and not e.get("ro", True)]
    for path in config.write_allowed:
        if any(_under(path, t) for t in writable):
            continue  # a writable mount, or inside one (then the mount decides)
        if path == "/tmp":
            options = tmp_options(config.limits.memory_bytes)
            entries.append({"kind": "tmpfs", "path": path, "options": options})
            continue
        source = config.write_sources.get(path) or kept_dir(host.data_dir, path)
        result.writable_dirs.append(source)
        entries.append(_bind(source, path, ro=False))
    # the workdir without code is an empty directory of the sandbox's own: nothing under it
    # comes from the host (before, with workdir /, every read_allowed path did)
    own = [e["path"] for e in entries if e["kind"] in ("bind", "tmpfs", "dir")]
    for path in config.read_allowed:
        if any(_under(path, t) for t in own):
            continue
        if os.path.exists(path):
            _check_host_read(config, path)
            entries.append(_bind(path, path))
        else:
            result.warnings.append(f"read_allowed {path} exists neither in a mount nor on the host")
    return entries


PUBLIC_RUNTIME_FILES = frozenset(
    {
        "/run/systemd/resolve/stub-resolv.conf",
        "/run/systemd/resolve/resolv.conf",
        "/run/resolvconf/resolv.conf",
        "/run/NetworkManager/resolv.conf",
        "/run/NetworkManager/no-stub-resolv.conf",
    }
)
"""Where ``/etc/resolv.conf`` leads on hosts whose resolver manages it (systemd-resolved,
resolvconf, NetworkManager): public files, shown even though ``/run`` is never bound."""


def _check_host_read(config: SandboxConfig, path: str) -> None:
    """Refuse a host bind of ``path`` that is, or resolves into, a denied host directory (the
    bind follows symlinks: ``/usr/lib/x -> /home/dsec/...`` binds the target)."""
    real = os.path.realpath(path)
    if real == "/":
        raise PlanError(f"read_allowed {path} would show the host's whole file system")
    if real in PUBLIC_RUNTIME_FILES and os.path.isfile(real):
        return  # /etc/resolv.conf on a host whose resolver keeps it under /run
    for denied in config.host_denied:
        guarded = os.path.realpath(denied)
        if _under(real, guarded) or _under(guarded, real):
            shown = path if real == path else f"{path} (resolved: {real})"
            raise PlanError(
                f"read_allowed {shown} would show the host's {guarded} to the sandbox, which "
                "this node never binds (other sandboxes' code, logs and keys, the host's shared "
                "temporary and runtime files); read a mount or the sandbox's own paths instead"
            )


def needs_disk_quota(config: SandboxConfig) -> bool:
    """Whether the sandbox has writable directories kept on the host (under its quota
    filesystem): a ``write_allowed`` path but ``/tmp`` that no writable mount covers and no
    ``write_sources`` entry places elsewhere — as :func:`_declared_entries` lays them out."""
    if config.limits.disk_bytes is None:
        return False
    writable = [m.target for m in config.mounts if not m.read_only]
    return any(
        path != "/tmp"
        and path not in config.write_sources
        and not any(_under(path, t) for t in writable)
        for path in config.write_allowed
    )


def _existing(path: Path, what: str) -> Path:
    if not path.exists():
        raise PlanError(f"{what}: source {path} does not exist")
    return path.resolve()


def _system_entries(
    host: HostPaths, uid: int, layout: list[dict[str, Any]], config: SandboxConfig | None = None
) -> list[dict[str, Any]]:
    gpu_devices = list(config.gpu_devices) if config is not None else []
    entries: list[dict[str, Any]] = [
        {"kind": "proc", "path": "/proc"},
        {"kind": "dev", "path": "/dev", "nodes": [*DEV_NODES, *gpu_devices]},
        _bind(host.semantic_site, SEMANTIC_TARGET),
    ]
    if config is not None:  # an MPS server's pipe directory (its clients connect there)
        entries += [_bind(src, target, ro=False) for target, src in config.gpu_binds.items()]
    if host.rules_path is not None:
        entries.append(_bind(host.rules_path, RULES_TARGET))
    if host.events_socket is not None:
        entries.append(_bind(host.events_socket, EVENTS_TARGET, ro=False))
    entries += _communication_entries(host)
    binds = [e["path"] for e in layout if e["kind"] == "bind"]
    identity = {
        "/etc/passwd": f"root:x:0:0::/:/nonexistent\nsandbox:x:{uid}:{uid}::/tmp:/nonexistent\n",
        "/etc/group": f"root:x:0:\nsandbox:x:{uid}:\n",
    }
    for path, content in identity.items():
        if not any(_under(path, b) for b in binds):
            entries.append({"kind": "file", "path": path, "content": content, "mode": 0o644})
    return entries


def _communication_entries(host: HostPaths) -> list[dict[str, Any]]:
    """The SDK's packages and the broker's socket.

    Only the socket's own directory is shown (read-only: connecting to a socket is not a write
    to the filesystem), never the node agent's ``run`` directory around it.
    """
    entries = [_bind(p, f"{SDK_TARGET}/{p.name}") for p in host.sdk_packages]
    entries += [_bind(p, f"{SDK_DEPS_TARGET}/{p.name}") for p in host.sdk_fallbacks]
    if host.ipc_dir is not None:
        entries.append(_bind(host.ipc_dir, IPC_TARGET))
    return entries


def _check_provided(
    config: SandboxConfig, declared: list[dict[str, Any]], provided: list[dict[str, Any]]
) -> None:
    """Refuse an entry the config declares (its code, mounts, writable and readable paths)
    inside one the node provides (the runtime's directories, the semantic layer, /proc, /dev,
    the node's sockets): it would replace what the node shows there, such as the interpreter a
    checkpointable sandbox's init (root) runs as its reaper, or the semantic layer. An entry
    above one is fine: the node's is bound over it (the depth order); so is a read-only bind of
    a host path at that same path (a ``read_allowed`` one) inside a bind of the host's own
    directory at its own path (a runtime directory): what the node shows there already."""
    for entry in declared:
        same = entry["kind"] == "bind" and entry.get("ro") and entry["src"] == entry["path"]
        for outer in provided:
            if same and outer["kind"] == "bind" and outer.get("src") == outer["path"]:
                continue
            if entry["path"] != outer["path"] and _under(entry["path"], outer["path"]):
                raise PlanError(
                    f"{_declared_by(config, entry['path'])} {entry['path']} lies inside "
                    f"{outer['path']}, which the node provides to every sandbox (its runtime, "
                    "the semantic layer, /proc, /dev); choose a path outside it"
                )


def _declared_by(config: SandboxConfig, path: str) -> str:
    """The config's field that declares the sandbox path ``path`` (for an error message)."""
    if any(m.target == path for m in config.mounts):
        return "mount"
    if path in config.write_allowed:
        return "write_allowed"
    if path in config.read_allowed:
        return "read_allowed"
    return "workdir" if path == config.workdir else "env_dir"


def _check_overlaps(layout: list[dict[str, Any]]) -> None:
    seen: dict[str, dict[str, Any]] = {}
    # Mounts by their path (a trailing "/" dropped): an entry's strict ancestors are looked up,
    # not every mount tried against every entry.
    mounts: dict[str, list[dict[str, Any]]] = {}
    for entry in layout:
        if entry["kind"] in ("bind", "tmpfs", "proc", "dev"):
            mounts.setdefault(entry["path"].rstrip("/") or "/", []).append(entry)
    for entry in layout:
        path = entry["path"]
        if path in seen and entry["kind"] != "dir":
            raise PlanError(f"{path} is the target of two mounts")
        seen[path] = entry
        for outer in (o for a in _ancestors(path) for o in mounts.get(a, ())):
            rel = os.path.relpath(path, outer["path"])
            src = outer.get("src")
            if entry["kind"] == "bind" and src and os.path.exists(os.path.join(src, rel)):
                continue
            raise PlanError(
                f"{path} lies inside the mount at {outer['path']}; choose a path outside it"
            )


def _landlock_sets(
    config: SandboxConfig,
    runtime: RuntimeView,
    host: HostPaths,
    layout: list[dict[str, Any]],
    result: PlanResult,
) -> tuple[list[str], list[str]]:
    read = [*runtime.ro_dirs, *runtime.ro_files]
    read += [str(p.resolve()) for p in config.extra_ro_paths]
    read += [SEMANTIC_TARGET, config.workdir, "/proc", "/dev", "/etc/passwd", "/etc/group"]
    if config.env_dir is not None:
        read.append(ENV_TARGET)
    if host.rules_path is not None:
        read.append(RULES_TARGET)
    if host.sdk_packages:
        read.append(SDK_TARGET)
    if host.sdk_fallbacks:
        read.append(SDK_DEPS_TARGET)
    read += config.read_allowed
    write = list(config.write_allowed) + list(DEV_WRITABLE)
    write += [f"/dev/{name}" for name in config.gpu_devices] + list(config.gpu_binds)
    if host.events_socket is not None:
        write.append(EVENTS_TARGET)
    granted = read + write
    for mount in config.mounts:
        if not any(_under(mount.target, g) for g in granted):
            result.warnings.append(
                f"mount {mount.target} is not under read_allowed: the sandbox cannot read it"
            )
    return sorted(set(read)), sorted(set(write))


def _argv(config: SandboxConfig, runtime: RuntimeView) -> list[str]:
    first, *rest = config.argv
    if first in ("python", "python3", f"python{runtime.version}"):
        return [runtime.executable, *rest]
    if not first.startswith("/"):
        raise PlanError(f"argv[0] {first!r}: use 'python' or an absolute path in the sandbox")
    return [first, *rest]


def encode_rules(rules: dict[str, Any]) -> bytes:
    """The rules file's bytes: the compiled rules (JSON types only) as ``marshal`` format 4,
    which the sandbox's interpreter reads without loading a module (any Python 3.4+)."""
    return marshal.dumps(rules, 4)


def user_site(version: str) -> str:
    """The user site-packages directory of a CPython ``version`` ("3.11") in the sandbox
    (``site.getusersitepackages()`` with ``PYTHONUSERBASE`` set to :data:`USER_BASE_TARGET`)."""
    return f"{USER_BASE_TARGET}/lib/python{version}/site-packages"


def workload_env(config: SandboxConfig, runtime: RuntimeView, host: HostPaths) -> dict[str, str]:
    """The workload's environment (secret values included; never persist the result)."""
    bin_dirs = [os.path.dirname(runtime.executable), "/usr/bin", "/bin"]
    env = {
        "PATH": ":".join(bin_dirs),
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        # (the semantic layer's usercustomize: see dsec_nodeagent/semantic/sandbox_site)
        "PYTHONUSERBASE": USER_BASE_TARGET,
        "PYTHONDONTWRITEBYTECODE": "1",
        "DSEC_SANDBOX_ID": config.sandbox_id,
    }
    site = env_site_dir(config.env_dir, runtime.version)
    if site is not None:
        env["DSEC_ENV_SITE"] = site
        if config.env_dir is not None and (config.env_dir / "bin").is_dir():
            env["PATH"] = f"{ENV_TARGET}/bin:{env['PATH']}"
    if host.rules_path is not None:
        env["DSEC_SEMANTIC_RULES"] = RULES_TARGET
    if host.events_socket is not None:
        env["DSEC_SEMANTIC_SOCKET"] = EVENTS_TARGET
    if host.sdk_packages:
        env["PYTHONPATH"] = SDK_TARGET
    if host.sdk_fallbacks:
        env["DSEC_SDK_DEPS"] = SDK_DEPS_TARGET
    env.update(config.env)
    env.update({k: v.get_secret_value() for k, v in config.secret_env.items()})
    env.update(agent_env(config))
    # The user site is where the semantic layer and the environment's packages come from
    # (usercustomize): a spec's own value cannot move or switch it off (build() warns).
    for name in SANDBOX_OWNED_ENV:
        env.pop(name, None)
    env["PYTHONUSERBASE"] = USER_BASE_TARGET
    return env


def agent_env(config: SandboxConfig) -> dict[str, str]:
    """The identity and the broker's socket the SDK reads; set last, so a spec's own variables
    cannot change them (the broker would refuse another name anyway). Without a broker
    (``ipc_dir`` unset) the socket is absent and a call fails with a clear ``BrokerUnavailable``.
    """
    if config.agent is None:
        return {}
    return {
        "DSEC_AGENT_NAME": config.agent.name,
        "DSEC_TASK_GROUP": config.agent.task_group,
        "DSEC_IPC_SOCKET": IPC_SOCKET_TARGET,
    }
