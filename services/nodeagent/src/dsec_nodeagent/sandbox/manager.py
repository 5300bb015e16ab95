"""The async face of the sandbox: launch, wait, stop, exec, logs, reconcile.

Event-friendly by construction: :meth:`SandboxManager.launch` returns when the workload runs with
every layer on (a :class:`SandboxReady`), ``on_exit`` receives a :class:`SandboxExited` after
everything was cleaned up, ``on_decision`` receives the semantic layer's decisions.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import marshal
import os
import shutil
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec_core.layout import NodeLayout
from dsec_core.retention import ENDED_MARK

from dsec_nodeagent.sandbox import (
    audit,
    cgroups,
    cpuhint,
    discovery,
    domain,
    landlock,
    notify,
    plan,
    quota,
    seccomp,
    zygote,
)
from dsec_nodeagent.sandbox.init import supervisor_plan
from dsec_nodeagent.sandbox.models import (
    AgentIdentity,
    ExitReason,
    Limits,
    SandboxConfig,
    SandboxExited,
    SandboxReady,
    SandboxStartError,
)
from dsec_nodeagent.sandbox.state import StateStore, is_alive, process_start_time
from dsec_nodeagent.semantic import site_dir
from dsec_nodeagent.semantic.channel import DecisionChannel, DecisionHandler

log = logging.getLogger(__name__)

ExitHandler = Callable[[SandboxExited], Awaitable[None]]
CgroupHook = Callable[[str, Path, int], Awaitable[None]]
"""``(sandbox_id, cgroup v2 dir, cgroup id)``, awaited before the workload starts."""

START_TIMEOUT_S = 30.0
IMAGE_SIZES_POOLED = 4
SHELL_REFILL_DELAY_S = 0.05
"""After a launch, how long before the next launch's shell is forked (see _refill_shell)."""
IMAGE_REFILL_DELAY_S = 0.15
"""How long after a start took a pooled disk image the pool's refill begins. Its mkfs, loop
attach and mount take CPU (and, in a worker thread, the GIL) that the start and then its
workload's interpreter start (~30-40 ms) would otherwise share: on 2 CPUs that was as much as
4 ms of a sandbox's first line. A start within the delay formats its own image, as the first
start does."""
RECENT_RESULTS = 256
_SRC = Path(__file__).resolve().parents[2]
# Run the pre-exec stage without site-packages (-S) and without executing the packages'
# __init__ modules: only the standard library and four small modules are imported, which keeps
# interpreter start-up (the largest layer of sandbox.ready) near its floor.
BOOTSTRAP = (
    "import sys\n"
    f"src = {str(_SRC)!r}\n"
    "for name in ('dsec_nodeagent', 'dsec_nodeagent.sandbox'):\n"
    "    module = type(sys)(name)\n"
    "    module.__path__ = [src + '/' + name.replace('.', '/')]\n"
    "    sys.modules[name] = module\n"
    "from dsec_nodeagent.sandbox.init import main\n"
    "sys.exit(main())\n"
)


@dataclass
class Sandbox:
    """A running sandbox known to this manager."""

    config_id: str
    ready: SandboxReady
    state: dict[str, Any]
    cgroup: cgroups.SandboxCgroup
    process: asyncio.subprocess.Process | None = None
    pidfd: int | None = None  # the supervisor's, when the zygote forked it (not our child)
    channel: DecisionChannel | None = None
    refusals: notify.RefusalReporter | None = None
    requested: ExitReason | None = None
    exited: asyncio.Future[SandboxExited] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    timer: asyncio.TimerHandle | None = None
    monitor: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class ReconcileReport:
    """What :meth:`SandboxManager.reconcile` did.

    Attributes:
        adopted: sandboxes still running, now watched again.
        cleaned: sandboxes that had ended (or were half-started); their exit results.
    """

    adopted: list[str]
    cleaned: list[SandboxExited]


class SandboxManager:
    """Starts and supervises sandboxes on this node (root only).

    Args:
        home: ``DSEC_HOME``; state under ``run/sandboxes``, logs and outputs under ``sandboxes``.
        python: interpreter that runs the pre-exec stage (default: this one).
        on_exit: awaited with every :class:`SandboxExited` (publish ``sandbox.exited`` there).
        on_decision: awaited with every semantic decision (publish ``policy.violation``).
        on_kernel_refusal: awaited with every system call the seccomp filter refused (the
            caller got ``EPERM``; publish ``policy.violation`` with layer ``kernel``).
        on_landlock_refusal: awaited with every file (or port, signal) access a sandbox's
            Landlock domain refused (the caller got ``EACCES``), read from the kernel's audit
            records by one :class:`.audit.LandlockAudit` per manager — which enables audit if it
            is disabled, until :meth:`shutdown` (see :mod:`.audit`). ``None``: not read.
        tune_cgroups: remount cgroup2 with ``favordynmods`` (see
            :func:`cgroups.favor_dynamic_modifications`).
        ipc_socket: the IPC broker's socket: each sandbox with an ``agent`` identity sees it
            (through a directory of its own holding only a link to it); ``None``: no broker.
        use_zygote: fork each sandbox's pre-exec stage from a launcher started once
            (:mod:`.zygote`) instead of starting an interpreter per sandbox; every layer is the
            same either way. When the launcher cannot be started, a launch falls back to a
            fresh interpreter (and logs why).
    """

    def __init__(
        self,
        home: Path,
        *,
        python: Path | None = None,
        on_exit: ExitHandler | None = None,
        on_decision: DecisionHandler | None = None,
        on_kernel_refusal: notify.RefusalHandler | None = None,
        on_landlock_refusal: audit.LandlockHandler | None = None,
        tune_cgroups: bool = True,
        ipc_socket: Path | None = None,
        uid_base: int = domain.UID_BASE,
        node_id: str = "node-1",
        use_zygote: bool = True,
    ) -> None:
        self.home = home.resolve()
        self.uid_base = uid_base  # node agents of one machine get disjoint uid ranges
        self.node_id = node_id  # names its cgroup parent: <unified>/dsec/<node id>/
        layout = NodeLayout.of(self.home)
        self.run_dir = layout.sandboxes_run
        self.data_root = layout.sandboxes
        self.cache_dir = layout.cache / "runtimes"
        self.python = python or Path(sys.executable)
        self.zygote = (
            zygote.Zygote(self.python, BOOTSTRAP, _init_env(), layout.sandbox_root_mount)
            if use_zygote
            else None
        )
        self.on_exit = on_exit
        self.on_decision = on_decision
        self.on_kernel_refusal = on_kernel_refusal
        self.on_landlock_refusal = on_landlock_refusal
        self._audit: audit.LandlockAudit | None = None
        # uid -> sandbox id, for audit records; kept after the exit (late records of the last
        # denials), overwritten when the uid is given to a new sandbox.
        self._uid_owners: dict[int, str] = {}
        # uids given to launches still under way (neither watched nor in a state file yet)
        self._starting_uids: set[int] = set()
        self._launching: set[str] = set()  # ids of the launches under way
        self.tune_cgroups = tune_cgroups
        self.ipc_socket = ipc_socket
        self.states = StateStore(self.run_dir)
        # Present while no manager watches this home's sandboxes (after shutdown() that kept
        # them, until the next reconcile()): a sandbox ending then removes its cgroups itself.
        self.unwatched_marker = self.home / "run" / "sandboxes-unwatched"
        # sandbox id -> (uid, identity): registered before the workload's first instruction,
        # so the broker can tell who connects before the sandbox is even reported ready.
        self._agents: dict[str, tuple[int, AgentIdentity]] = {}
        self._sandboxes: dict[str, Sandbox] = {}
        self._ended: dict[str, SandboxExited] = {}  # recent results, for wait() after the end
        self._hierarchy: cgroups.Hierarchy | None = None
        # The marshalled shared layout entries of the last plan of each runtime (at most
        # SHARED_KEPT): the next sandbox's init binds them while it is planned.
        self._shared_layouts: OrderedDict[tuple[str, ...], bytes] = OrderedDict()
        self._facts: tuple[int, int, bytes] | None = None
        self._exec_filter: str | None = None  # hex; the same for every sandbox of this kernel
        self._views: dict[
            tuple[Path, tuple[Path, ...]],
            tuple[tuple[tuple[int, int, int], ...], discovery.RuntimeView],
        ] = {}
        self._images = quota.ImagePool(layout.cache / "disk-images")
        self._image_sizes: dict[int, None] = {}  # recently asked sizes, oldest first
        self._image_fill: asyncio.Task[None] | None = None
        self._shell: zygote.PendingFork | None = None  # forked ahead for the next launch
        self._shell_timer: asyncio.TimerHandle | None = None
        self._image_timer: asyncio.TimerHandle | None = None
        self._images_again = False  # a start took or asked for an image during a fill
        self._closing = False

    # ------------------------------------------------------------------ queries

    def get(self, sandbox_id: str) -> Sandbox | None:
        """The running sandbox, if this manager watches it."""
        return self._sandboxes.get(sandbox_id)

    def running(self) -> list[str]:
        """Ids of the sandboxes this manager watches."""
        return sorted(self._sandboxes)

    def identify(self, pid: int, uid: int) -> AgentIdentity | None:
        """The agent identity of the sandbox process ``pid`` runs in, or ``None``.

        The sandbox is found from the process's cgroup (which its tasks cannot leave) and must
        also run under ``uid`` (each sandbox has a uid of its own): what the IPC broker pins a
        connecting process to.
        """
        sandbox_id = cgroups.sandbox_of_process(pid)
        entry = self._agents.get(sandbox_id) if sandbox_id is not None else None
        if entry is None or entry[0] != uid:
            return None
        return entry[1]

    def log_paths(self, sandbox_id: str) -> tuple[Path, Path]:
        """``(stdout, stderr)`` log files of a sandbox (kept after exit until :meth:`purge`)."""
        logs = self.data_root / sandbox_id / "logs"
        return logs / "stdout.log", logs / "stderr.log"

    # ------------------------------------------------------------------ launch

    async def launch(
        self, config: SandboxConfig, *, before_start: CgroupHook | None = None
    ) -> SandboxReady:
        """Start a sandbox; return once the workload was exec'd with every layer on.

        Args:
            config: what to run and how.
            before_start: awaited once the sandbox's cgroup exists and before any process
                joins it (the sandbox's init, handed its plan already, binds its root view
                meanwhile and waits for this to end) — attach the eBPF egress programs here, so
                that no connect can precede them. Its time counts in the ``cgroup`` layer; an
                error aborts the start.

        Raises:
            SandboxStartError: naming the failing layer; nothing is left behind.
        """
        t0 = time.monotonic_ns()
        sid = config.sandbox_id
        # Taken at once (no await before it): a second launch of the same id while the first is
        # under way is refused here, not failed later by a directory the first made — whose
        # clean-up would remove the first's run directory, disk quota and state.
        if self.busy(sid):
            raise SandboxStartError(sid, "plan", "a sandbox with this id already exists")
        self._launching.add(sid)
        try:
            return await self._launch(config, before_start, t0)
        finally:
            self._launching.discard(sid)

    async def _launch(
        self, config: SandboxConfig, before_start: CgroupHook | None, t0: int
    ) -> SandboxReady:
        sid = config.sandbox_id
        run_dir = self.run_dir / sid
        marks: dict[str, int] = {}
        cgroup: cgroups.SandboxCgroup | None = None
        channel: DecisionChannel | None = None
        data_dir = self.data_root / sid
        early: zygote.PendingFork | None = None
        disk: asyncio.Future[None] | None = None
        starting = -1
        try:
            quota_needed = plan.needs_disk_quota(config)
            # The disk quota from the pool of images mounted ahead (well under a millisecond),
            # before the fork below: the sandbox's init copies the mount tree as it is then.
            taken = quota_needed and self._take_quota(config, data_dir)
            runtime_key = _runtime_key(config)
            if self.zygote is not None and (taken or not quota_needed):
                # The supervisor and its init, forked ahead (else now), make what no plan
                # decides (the mount namespace, the root view's /proc and /dev) while the
                # sandbox is planned.
                early = self._take_shell()
                early.mount_now(self._shared_layouts.get(runtime_key, b""))
            built, uid = await self._plan(config, run_dir)
            shared = _shared_entries(built.plan)
            self._remember_shared(runtime_key, shared)
            self._starting_uids.add(uid)
            starting = uid
            if quota_needed and not taken:
                # The disk quota's mkfs and loop mount run in a worker thread while the cgroup
                # and the decision channel are made here; awaited before the fork below.
                disk = asyncio.ensure_future(self._make_quota(config, data_dir, built))
            self._uid_owners[uid] = sid
            self._watch_landlock(built.warnings)
            if self._audit is not None:  # (a flooding sandbox's earlier uid: heard again)
                self._audit.release_uid(uid)
            if config.agent is not None:
                self._agents[sid] = (uid, config.agent)
            marks["plan"] = time.monotonic_ns()
            planned = self._planned_cgroup(config)
            built.plan["cgroup_procs"] = planned.procs_files()
            built.plan["reap"] = planned.reaper_plan(self.unwatched_marker)
            if disk is not None:
                # (shielded: a cancelled launch must not cancel the mount's task while its
                # thread still mounts; the clean-up below waits for it, then undoes it)
                await asyncio.shield(disk)
            if early is None and self.zygote is not None:
                early = self._take_shell()
                early.mount_now(shared)  # after the quota's mount, which init must see
            self._prepare_dirs(built, uid)
            if config.semantic_rules is not None:
                channel = await DecisionChannel.open(
                    sid, run_dir / "events.sock", uid, self.on_decision
                )

            async def make_cgroup() -> None:
                # The state file first, naming the cgroup before it exists: a node agent
                # restarted after a crash removes it (or finds it absent). A crash before this
                # write leaves no process (init exits at the go pipe's EOF) and no cgroup.
                nonlocal cgroup
                if quota_needed:  # (mounted by now) its I/O is bounded on its loop device
                    planned.disk = cgroups.loop_device_of(quota.mount_point(data_dir))
                self.states.write(
                    sid,
                    {
                        "sandbox_id": sid,
                        "phase": "starting",
                        "cgroup": planned.to_state(),
                        "run_dir": str(run_dir),
                        # reserved while this file lasts: a launch cancelled, or whose clean-up
                        # failed, may leave processes or files of this uid behind
                        "uid": uid,
                    },
                )
                try:
                    planned.make(self._hierarchy_now(), config.limits)
                    cgroup = planned
                except Exception as exc:
                    raise SandboxStartError(sid, "cgroup", str(exc)) from exc

            async def attach() -> None:
                # The caller's hook on the cgroup (the node agent's egress programs, GPU
                # devices, proxy): run while the sandbox's init binds its root view.
                assert before_start is not None and cgroup is not None
                try:
                    await before_start(sid, cgroup.v2_dir, cgroup.inode)
                except SandboxStartError:
                    raise
                except Exception as exc:
                    raise SandboxStartError(sid, "cgroup", str(exc)) from exc

            spawned, records, init_pid, ready_ns = await self._spawn(
                config,
                built.plan,
                marks,
                early,
                make_cgroup,
                attach if before_start is not None else None,
            )
            # What follows (the sandbox's state, its watchers) runs beside the workload's
            # first milliseconds, not on their CPU (where the execve's wake-up put it).
            with contextlib.suppress(OSError):
                cpuhint.leave_cpu_of(init_pid)
            assert cgroup is not None  # made before the sandbox's init could go on
        except SandboxStartError:
            await self._abort_after(disk, sid, cgroup, channel, run_dir, early)
            raise
        except Exception as exc:
            await self._abort_after(disk, sid, cgroup, channel, run_dir, early)
            stage = "plan" if "plan" not in marks else "cgroup"
            stage = stage if "spawn_start" not in marks else "spawn"
            raise SandboxStartError(sid, stage, str(exc)) from exc
        except BaseException:  # cancelled (the node agent stopping, a migration given up)
            # The same clean-up, to its end even if cancelled again (shielded): else the
            # cgroup, state file, run directory and disk quota stayed until a restart.
            cleanup = asyncio.ensure_future(
                self._abort_after(disk, sid, cgroup, channel, run_dir, early)
            )
            with contextlib.suppress(Exception):
                await asyncio.shield(cleanup)
            raise
        finally:
            # (the state written below names the uid before any other launch can run)
            self._starting_uids.discard(starting)
            self._refill_shell()
        process, supervisor_pid, pidfd = spawned
        refusals = self._report_refusals(sid, supervisor_pid, built.warnings)
        ready = self._ready(config, built, uid, cgroup, t0, marks, records, ready_ns, init_pid)
        state = self._state(config, built.plan, ready, supervisor_pid, init_pid, cgroup, run_dir)
        self.states.write(sid, state)
        sandbox = Sandbox(
            sid,
            ready,
            state,
            cgroup,
            process=process,
            pidfd=pidfd,
            channel=channel,
            refusals=refusals,
        )
        self._watch(sandbox)
        return ready

    async def settle(self) -> None:
        """Return once the background work of earlier launches is done: the next launch's
        shell forked and the disk image pool refilled (each begins a moment after a launch).
        For a benchmark or a test that wants the node quiet before it measures."""
        loop = asyncio.get_running_loop()
        while True:
            timers = [t for t in (self._shell_timer, self._image_timer) if t is not None]
            if timers:
                await asyncio.sleep(max(0.0, max(t.when() for t in timers) - loop.time()) + 0.001)
                continue
            if self._image_fill is not None and not self._image_fill.done():
                await asyncio.gather(self._image_fill, return_exceptions=True)
                continue
            if self._shell is not None:
                await self._shell.forked()
            return

    def _take_shell(self) -> zygote.PendingFork:
        """The supervisor and init forked ahead for the next launch (each serves one launch
        only), or, when there is none or it failed, a fork asked for now."""
        assert self.zygote is not None
        shell, self._shell = self._shell, None
        if shell is None or shell.failed:
            if shell is not None:
                shell.drop_failed()
            shell = self.zygote.fork()
        return shell

    def _refill_shell(self) -> None:
        """Have the next launch's supervisor and init forked soon after a launch, so that the
        fork, the pid namespace and init are not on its start path. The shell holds no copy of
        the host's mount tree until its launch says so (:meth:`.zygote.PendingFork.mount_now`).

        Not at once: the three forks would take CPU from the workload just started, whose
        interpreter start is what its user waits for (on 2 CPUs, as much as ~5 ms of its first
        line); a launch before then forks its own, as without a shell."""
        if self.zygote is None or self._shell is not None or self._closing:
            return
        if self._shell_timer is None:
            loop = asyncio.get_running_loop()
            self._shell_timer = loop.call_later(SHELL_REFILL_DELAY_S, self._refill_now)

    def _refill_now(self) -> None:
        self._shell_timer = None
        if self.zygote is not None and self._shell is None and not self._closing:
            self._shell = self.zygote.fork()

    async def _plan(self, config: SandboxConfig, run_dir: Path) -> tuple[plan.PlanResult, int]:
        sdk, sdk_deps = sdk_packages() if config.agent is not None else ((), ())
        extra = [p for p in (config.env_dir, *config.extra_ro_paths, *sdk_deps) if p is not None]
        view = await self._runtime_view(config.runtime, extra)
        uid = domain.allocate_uid(config.sandbox_id, self._uids_in_use(), base=self.uid_base)
        run_dir.mkdir(parents=True, exist_ok=False)  # (its root: made by _spawn when needed)
        ipc_dir = self._ipc_dir(config, run_dir)
        rules_path = None
        if config.semantic_rules is not None:
            rules_path = run_dir / plan.RULES_FILE
            rules_path.write_bytes(plan.encode_rules(config.semantic_rules))
        host = plan.HostPaths(
            root=run_dir / "root",
            exit_path=run_dir / "exit.json",
            data_dir=self.data_root / config.sandbox_id,
            semantic_site=site_dir(),
            rules_path=rules_path,
            events_socket=run_dir / "events.sock" if rules_path else None,
            ipc_dir=ipc_dir,
            sdk_packages=sdk,
            sdk_fallbacks=sdk_deps,
        )
        abi, last_cap, program = self._kernel_facts()
        facts = plan.KernelFacts(abi, last_cap, program, [])
        built = plan.build(config, view, host, facts, uid)
        if ipc_dir is not None and not (ipc_dir / plan.IPC_SOCKET_NAME).exists():
            built.warnings.append(
                f"the IPC broker's socket {self.ipc_socket} could not be shown to the sandbox "
                "(no broker, or another filesystem than the sandbox's run directory): its tool "
                "calls will fail"
            )
        return built, uid

    async def _runtime_view(self, runtime: Path, extra: list[Path]) -> discovery.RuntimeView:
        """:func:`discovery.discover_cached`, remembered while its inputs are unchanged.

        The inputs' identity (device, inode, mtime of what each path points to: what the disk
        cache keys on) is a few ``stat`` calls; only a change, or the first sandbox of a runtime,
        goes to a worker thread (whose hand-off is on every start's path otherwise).
        """
        key = (runtime, tuple(extra))
        try:
            stamp = tuple(_identity(path) for path in (runtime, *extra))
        except OSError:
            stamp = None
        known = self._views.get(key)
        if stamp is not None and known is not None and known[0] == stamp:
            return known[1]
        view = await asyncio.to_thread(discovery.discover_cached, runtime, extra, self.cache_dir)
        if stamp is not None:
            self._views[key] = (stamp, view)
        return view

    def _take_quota(self, config: SandboxConfig, data_dir: Path) -> bool:
        """The usual case of :meth:`_make_quota`: an image the pool formatted, attached and
        mounted ahead, moved in on the event loop (a worker thread's hand-off would cost more
        than the rename and bind mount). ``False``: none ready, or this sandbox's earlier
        outputs must be carried over (then :meth:`_make_quota`)."""
        size = config.limits.disk_bytes
        if size is None or quota.is_mounted(data_dir):
            return False
        if not quota.take_mounted(data_dir, size, self._images):
            return False
        self._refill_images(size)
        return True

    async def _make_quota(
        self, config: SandboxConfig, data_dir: Path, built: plan.PlanResult
    ) -> None:
        """Put the writable directories kept on the host on a filesystem of ``disk_bytes``."""
        fs = quota.mount_point(data_dir)
        if config.limits.disk_bytes is None or not any(
            d.is_relative_to(fs) for d in built.writable_dirs
        ):
            return
        size = config.limits.disk_bytes
        if quota.is_mounted(data_dir):  # a leftover of an earlier start with this id
            await asyncio.to_thread(quota.release, data_dir, keep_outputs=False)
        try:
            await asyncio.to_thread(quota.create, data_dir, size, self._images)
        except quota.QuotaError as exc:
            raise SandboxStartError(config.sandbox_id, "disk", str(exc)) from exc
        self._refill_images(size)

    def _refill_images(self, size: int) -> None:
        """Format the next images of the recently used sizes in the background (mkfs off the
        start path)."""
        self._image_sizes.pop(size, None)
        self._image_sizes[size] = None
        while len(self._image_sizes) > IMAGE_SIZES_POOLED:
            self._image_sizes.pop(next(iter(self._image_sizes)))
        if self._image_fill is not None and not self._image_fill.done():
            # The fill under way may have passed this size (or its image was just taken):
            # another round follows it.
            self._images_again = True
            return
        self._schedule_fill()

    def _schedule_fill(self) -> None:
        if self._image_timer is None and not self._closing:
            loop = asyncio.get_running_loop()
            self._image_timer = loop.call_later(IMAGE_REFILL_DELAY_S, self._fill_images)

    def _fill_images(self) -> None:
        self._image_timer = None
        if self._closing or (self._image_fill is not None and not self._image_fill.done()):
            return
        self._images_again = False

        async def fill() -> None:
            try:
                await asyncio.to_thread(self._images.prune, set(self._image_sizes))
                for wanted in list(self._image_sizes):
                    await asyncio.to_thread(self._images.fill, wanted)
            except (OSError, quota.QuotaError) as exc:  # a start formats its own instead
                log.warning("cannot prepare disk images: %s", exc)
            if self._images_again:  # a start during this round: the next one, as delayed
                self._schedule_fill()

        self._image_fill = asyncio.ensure_future(fill())

    def _ipc_dir(self, config: SandboxConfig, run_dir: Path) -> Path | None:
        """The sandbox's view of the broker: a directory holding only a link to its socket."""
        if self.ipc_socket is None or config.agent is None:
            return None
        ipc_dir = run_dir / "ipc"
        ipc_dir.mkdir(mode=0o755)
        self._link_ipc(ipc_dir)
        return ipc_dir

    def _link_ipc(self, ipc_dir: Path) -> None:
        """(Re)link the broker's socket into ``ipc_dir``.

        A hard link, not a bind mount of the socket: a restarted broker binds a new socket
        inode, and replacing the link inside the (bind-mounted) directory shows the new one to
        sandboxes that are already running. When it cannot be linked (no broker, another
        filesystem) the link stays absent: the sandbox runs, its calls fail with
        ``BrokerUnavailable``, and a launch says so in its warnings.
        """
        assert self.ipc_socket is not None
        staging = ipc_dir / f".{plan.IPC_SOCKET_NAME}.new"
        with contextlib.suppress(FileNotFoundError):
            staging.unlink()
        try:
            os.link(self.ipc_socket, staging)
            os.replace(staging, ipc_dir / plan.IPC_SOCKET_NAME)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                staging.unlink()

    def _kernel_facts(self) -> tuple[int, int, bytes]:
        if self._facts is None:
            _compile_sandbox_site()
            last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
            self._facts = (landlock.abi_version(), last_cap, seccomp.build_filter(notify=True))
        return self._facts

    def _report_refusals(
        self, sid: str, supervisor_pid: int, warnings: list[str] | None = None
    ) -> notify.RefusalReporter | None:
        """Watch the sandbox's seccomp listener (kept by its supervisor) and report refusals."""
        try:
            fd = notify.take_listener(supervisor_pid)
        except OSError as exc:
            # The filter still refuses (ENOSYS, or the call waits while the listener is held):
            # only the events are missing.
            message = f"kernel refusals of sandbox {sid} will not be reported: {exc}"
            log.warning(message)
            if warnings is not None:
                warnings.append(message)
            return None
        return notify.RefusalReporter(sid, fd, self.on_kernel_refusal)

    def _watch_landlock(self, warnings: list[str] | None = None) -> None:
        """Start reading Landlock's audit records (once per manager), when asked to report them."""
        if self.on_landlock_refusal is None or self._audit is not None:
            return
        reader = audit.LandlockAudit(self._sandbox_of, self.on_landlock_refusal)
        try:
            reader.start()
        except OSError as exc:
            # Landlock still refuses: only the events are missing.
            message = f"Landlock refusals will not be reported (audit unavailable): {exc}"
            log.warning(message)
            if warnings is not None:
                warnings.append(message)
            return
        self._audit = reader

    def _sandbox_of(self, pid: int | None, uid: int | None) -> str | None:
        """The sandbox of this manager an audited process belongs to: by its uid (each sandbox
        has its own, and it outlives the process), else by the cgroup of a live ``pid``."""
        if uid is not None and uid in self._uid_owners:
            return self._uid_owners[uid]
        sid = cgroups.sandbox_of_process(pid) if pid is not None else None
        return sid if sid is not None and sid in self._sandboxes else None

    def _hierarchy_now(self) -> cgroups.Hierarchy:
        if self._hierarchy is None:
            self._hierarchy = cgroups.detect()
            if self.tune_cgroups:
                cgroups.favor_dynamic_modifications(self._hierarchy)
        return self._hierarchy

    def _remember_shared(self, key: tuple[str, ...], shared: bytes) -> None:
        self._shared_layouts[key] = shared
        self._shared_layouts.move_to_end(key)
        while len(self._shared_layouts) > SHARED_KEPT:
            self._shared_layouts.popitem(last=False)

    def _planned_cgroup(self, config: SandboxConfig) -> cgroups.SandboxCgroup:
        """The sandbox's cgroups, named (its plan holds them) but not made yet."""
        return cgroups.SandboxCgroup.planned(
            self._hierarchy_now(), config.sandbox_id, node=self.node_id
        )

    def create_cgroup(
        self, sandbox_id: str, limits: Limits, *, disk: bool = False
    ) -> cgroups.SandboxCgroup:
        """A sandbox's fresh cgroups under this node's parent (a launch, or a restore); with
        ``disk``, its disk quota (mounted) is the disk its I/O bounds name."""
        own = cgroups.loop_device_of(quota.mount_point(self.data_root / sandbox_id)) if disk else ""
        return cgroups.SandboxCgroup.create(
            self._hierarchy_now(), sandbox_id, limits, node=self.node_id, disk=own
        )

    async def prepare_restored(
        self, sandbox_id: str, uid: int, *, ipc: bool, semantic: bool
    ) -> DecisionChannel | None:
        """The node-side ends a restored sandbox's root view binds (before ``criu restore``):
        its view of this node's broker (``ipc``) and its semantic layer's channel."""
        run_dir = self.run_dir / sandbox_id
        run_dir.mkdir(parents=True, exist_ok=True)
        if ipc and self.ipc_socket is not None:
            (run_dir / "ipc").mkdir(mode=0o755, exist_ok=True)
            self._link_ipc(run_dir / "ipc")
        if not semantic:
            return None
        return await DecisionChannel.open(
            sandbox_id, run_dir / "events.sock", uid, self.on_decision
        )

    def adopt_restored(
        self,
        state: dict[str, Any],
        cgroup: cgroups.SandboxCgroup,
        process: asyncio.subprocess.Process,
        channel: DecisionChannel | None = None,
    ) -> None:
        """Watch a sandbox another node checkpointed and this one restored
        (``dsec_nodeagent.migration``): ``state`` as :meth:`_state` writes it, its supervisor
        the restorer ``process``. Its seccomp listener did not come along (CRIU restores the
        filter, not the listener): its refusals still fail, unreported."""
        sid = state["sandbox_id"]
        ready = SandboxReady.model_validate(state["ready"])
        self.states.write(sid, state)
        self._adopt_agent(state, ready.uid)
        self._uid_owners[ready.uid] = sid
        self._watch(Sandbox(sid, ready, state, cgroup, process=process, channel=channel))
        self._starting_uids.discard(ready.uid)  # (reserve_uid's: watched from now on)

    def reserve_uid(self, uid: int) -> bool:
        """Hold ``uid`` for a sandbox arriving from another node (it keeps its uid: its files
        and restored processes have it) until :meth:`adopt_restored` or :meth:`release_uid`;
        ``False`` when a sandbox of this node has it already (two would share it)."""
        if uid in self._uids_in_use():
            return False
        self._starting_uids.add(uid)
        return True

    def release_uid(self, uid: int) -> None:
        """Give up a :meth:`reserve_uid` (the arrival failed)."""
        self._starting_uids.discard(uid)

    def _uids_in_use(self) -> set[int]:
        """Those of watched sandboxes, of launches under way, and named by state files."""
        watched = {s.ready.uid for s in self._sandboxes.values()}
        return watched | self._starting_uids | self.states.uids()

    def _prepare_dirs(self, built: plan.PlanResult, uid: int) -> None:
        for path in built.writable_dirs:
            path.mkdir(parents=True, exist_ok=True)
            os.chown(path, uid, uid)
            os.chmod(path, 0o750)

    async def _spawn(
        self,
        config: SandboxConfig,
        the_plan: dict[str, Any],
        marks: dict[str, int],
        early: zygote.PendingFork | None,
        make_cgroup: Callable[[], Awaitable[None]],
        attach: Callable[[], Awaitable[None]] | None,
    ) -> tuple[
        tuple[asyncio.subprocess.Process | None, int, int | None], list[dict[str, Any]], int, int
    ]:
        """Start the pre-exec stage (forked by the zygote, else a fresh interpreter): make the
        cgroups (``make_cgroup``), give it the plan, run ``attach`` on the cgroups, read its
        reports until the workload's execve.

        The cgroups come before the plan: once init has its plan, init, the workload's
        process and the supervisor all wake, and on a node with few CPUs they took the node
        agent's CPU while it made the cgroups that init then waited for (made after the
        hand-over, beside init's binding, the cgroups were ready ~1.5 ms after init's plan on
        the project's 2-vCPU VM; made first, ~0.5 ms before it). A forked one waits for the
        *go*, a byte on a pipe, before it joins them: written right after the hand-over, or,
        where there is an ``attach`` (the node agent's egress programs: more work than init's
        binding), once that is done, while init binds. The go pipe's EOF without that byte
        (the launch failed) makes init exit having run nothing. A fresh interpreter gets its
        plan once both are done.

        Returns ``((process or None, supervisor pid, its pidfd or None), records, init pid,
        ready ns)``."""
        stdout_path, stderr_path = self.log_paths(config.sandbox_id)
        stdout_path.parent.mkdir(parents=True, exist_ok=True)
        report_r, report_w = os.pipe()
        go_r, go_w = os.pipe()
        process: asyncio.subprocess.Process | None = None
        pidfd: int | None = None
        data = marshal.dumps(the_plan)
        try:
            try:
                with open(stdout_path, "ab") as out, open(stderr_path, "ab") as err:
                    await make_cgroup()
                    if attach is None:
                        marks["cgroup"] = time.monotonic_ns()
                    if early is not None:
                        marks["spawn_start"] = time.monotonic_ns()
                        try:
                            pid, pidfd = await early.hand_over(
                                data,
                                marshal.dumps(supervisor_plan(the_plan)),
                                report_w,
                                out.fileno(),
                                err.fileno(),
                                go_r,
                            )
                        except zygote.ZygoteError as exc:
                            log.warning("%s; starting the pre-exec stage directly", exc)
                        if pidfd is not None and attach is None:
                            # Once the whole hand-over went through (init sees it well
                            # before it needs it): a failed one must leave init without it.
                            with contextlib.suppress(OSError):  # init died: its report says
                                os.write(go_w, b"1")
                    if pidfd is None:
                        if attach is not None:
                            await attach()
                            marks["cgroup"] = time.monotonic_ns()
                        # (a zygote's sandbox mounts its root elsewhere)
                        Path(the_plan["root"]).mkdir(exist_ok=True)
                        marks["spawn_start"] = time.monotonic_ns()
                        process = await self._spawn_interpreter(data, report_w, out, err)
                        pid = process.pid
            finally:
                os.close(report_w)
                os.close(go_r)
            if pidfd is not None and attach is not None:
                marks["cgroup_start"] = time.monotonic_ns()
                try:
                    await attach()
                except BaseException:
                    os.close(go_w)  # no go: init exits, then its supervisor
                    go_w = -1
                    # (awaited directly, not as wait_for's task: a task cancelled before it
                    # ran never reached wait_pidfd's close of the pidfd)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(START_TIMEOUT_S):
                            await zygote.wait_pidfd(pidfd)
                    raise
                marks["cgroup"] = time.monotonic_ns()
                with contextlib.suppress(OSError):  # init died already: its report says why
                    os.write(go_w, b"1")
        except BaseException:
            os.close(report_r)
            raise
        finally:
            if go_w >= 0:
                os.close(go_w)
        try:
            records, ready_ns = await _read_reports(report_r, START_TIMEOUT_S)
        except BaseException:  # no ready signal in time, or cancelled: the launch's clean-up
            if pidfd is not None:  # kills the cgroup; no one waits on the supervisor's pidfd
                os.close(pidfd)
            raise
        errors = [r for r in records if "error" in r]
        init_pid = next((r["init_pid"] for r in records if "init_pid" in r), None)
        if errors or init_pid is None or not any(r.get("stage") == "exec" for r in records):
            if process is not None:
                await process.wait()
            elif pidfd is not None:
                await zygote.wait_pidfd(pidfd)
            first = errors[0] if errors else {"stage": "spawn", "error": _tail(stderr_path)}
            raise SandboxStartError(config.sandbox_id, first["stage"], first["error"])
        return (process, pid, pidfd), records, int(init_pid), ready_ns

    async def _spawn_interpreter(
        self, data: bytes, report_w: int, out: Any, err: Any
    ) -> asyncio.subprocess.Process:
        """The pre-exec stage as a fresh interpreter (no zygote, or it cannot start)."""
        plan_r, plan_w = os.pipe()
        try:
            process = await self._exec_interpreter(plan_r, report_w, out, err)
        finally:
            os.close(plan_r)
        try:
            await asyncio.to_thread(_write_all, plan_w, data)
        finally:
            os.close(plan_w)
        return process

    async def _exec_interpreter(
        self, plan_r: int, report_w: int, out: Any, err: Any
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            str(self.python),
            "-I",
            "-S",
            "-c",
            BOOTSTRAP,
            "run",
            str(plan_r),
            str(report_w),
            pass_fds=(plan_r, report_w),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            env=_init_env(),
        )

    def _ready(
        self,
        config: SandboxConfig,
        built: plan.PlanResult,
        uid: int,
        cgroup: cgroups.SandboxCgroup,
        t0: int,
        marks: dict[str, int],
        records: list[dict[str, Any]],
        ready_ns: int,
        init_pid: int,
    ) -> SandboxReady:
        stdout_path, stderr_path = self.log_paths(config.sandbox_id)
        return SandboxReady(
            sandbox_id=config.sandbox_id,
            pid=init_pid,
            uid=uid,
            cgroup_path=str(cgroup.v2_dir),
            cgroup_id=cgroup.inode,
            started_at=time.time(),
            ready_ms=round((ready_ns - t0) / 1e6, 3),
            timings_ms=domain.stage_timings(t0, marks, records, ready_ns),
            stdout_path=str(stdout_path),
            stderr_path=str(stderr_path),
            warnings=built.warnings,
            metadata=config.metadata,
        )

    def _state(
        self,
        config: SandboxConfig,
        the_plan: dict[str, Any],
        ready: SandboxReady,
        supervisor_pid: int,
        init_pid: int,
        cgroup: cgroups.SandboxCgroup,
        run_dir: Path,
    ) -> dict[str, Any]:
        secret_names = set(config.secret_env)
        exec_plan = {
            k: the_plan[k]
            for k in (
                "uid",
                "gid",
                "unshare_net",
                "landlock",
                "seccomp",
                "cap_last_cap",
                "cwd",
                "cgroup_procs",
                "python",
                "nofile",
            )
        }
        exec_plan["env"] = {k: v for k, v in the_plan["env"].items() if k not in secret_names}
        # `sandbox exec` has no listener to hand over: its filter fails denied calls itself.
        if self._exec_filter is None:
            self._exec_filter = seccomp.build_filter().hex()
        exec_plan["seccomp"] = self._exec_filter
        deadline = time.time() + config.timeout_s if config.timeout_s else None
        return {
            "sandbox_id": config.sandbox_id,
            "phase": "running",
            "uid": ready.uid,
            "supervisor_pid": supervisor_pid,
            "supervisor_start": process_start_time(supervisor_pid),
            "init_pid": init_pid,
            "cgroup": cgroup.to_state(),
            "run_dir": str(run_dir),
            "deadline": deadline,
            "ready": ready.model_dump(mode="json"),
            "exec_plan": exec_plan,
            "secret_env_names": sorted(secret_names),
            "agent": config.agent.model_dump() if config.agent is not None else None,
            "checkpointable": config.checkpointable,
        }

    async def _abort_after(
        self,
        disk: asyncio.Future[None] | None,
        sid: str,
        cgroup: cgroups.SandboxCgroup | None,
        channel: DecisionChannel | None,
        run_dir: Path,
        early: zygote.PendingFork | None,
    ) -> None:
        """A failed or cancelled launch's clean-up, once its disk quota's mount (``disk``, in a
        worker thread) has ended."""
        await _settled(disk)
        await self._abort(sid, cgroup, channel, run_dir, early)

    async def _abort(
        self,
        sid: str,
        cgroup: cgroups.SandboxCgroup | None,
        channel: DecisionChannel | None,
        run_dir: Path,
        early: zygote.PendingFork | None = None,
    ) -> None:
        self._agents.pop(sid, None)
        if early is not None:
            await early.discard()
        if channel is not None:
            await channel.close()
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)
        await asyncio.to_thread(shutil.rmtree, run_dir, True)
        with contextlib.suppress(quota.QuotaError):
            await asyncio.to_thread(quota.release, self.data_root / sid, keep_outputs=False)
        self.states.remove(sid)

    # ------------------------------------------------------------------ supervision

    def _watch(self, sandbox: Sandbox) -> None:
        self._sandboxes[sandbox.config_id] = sandbox
        deadline = sandbox.state.get("deadline")
        if deadline is not None:
            delay = max(0.0, deadline - time.time())
            sandbox.timer = asyncio.get_running_loop().call_later(
                delay,
                lambda: asyncio.ensure_future(
                    self.stop(sandbox.config_id, reason=ExitReason.TIMEOUT, grace_s=1.0)
                ),
            )
        sandbox.monitor = asyncio.ensure_future(self._monitor(sandbox))

    async def _monitor(self, sandbox: Sandbox) -> None:
        if sandbox.process is not None:
            await sandbox.process.wait()
        elif sandbox.pidfd is not None:
            await zygote.wait_pidfd(sandbox.pidfd)  # closes it
            sandbox.pidfd = None
        else:
            await _wait_pid(sandbox.state["supervisor_pid"], sandbox.state["supervisor_start"])
        if sandbox.refusals is not None:
            await sandbox.refusals.close()
        result = await self._finish(
            sandbox.state, sandbox.cgroup, sandbox.requested, sandbox.channel
        )
        self._remember(result)
        self._sandboxes.pop(sandbox.config_id, None)
        if sandbox.timer is not None:
            sandbox.timer.cancel()
        if not sandbox.exited.done():
            sandbox.exited.set_result(result)
        if self.on_exit is not None:
            await self.on_exit(result)

    async def _finish(
        self,
        state: dict[str, Any],
        cgroup: cgroups.SandboxCgroup | None,
        requested: ExitReason | None,
        channel: DecisionChannel | None,
    ) -> SandboxExited:
        """Read how it ended, classify, clean everything up."""
        sid = state["sandbox_id"]
        self._agents.pop(sid, None)
        run_dir = Path(state["run_dir"])
        outcome = _read_json(run_dir / "exit.json")
        counters = (outcome or {}).get("counters") or {}  # read by a supervisor that reaped
        oom = max(cgroup.oom_kills() if cgroup else 0, int(counters.get("oom_kills", 0)))
        pids_hits = max(
            cgroup.pids_limit_hits() if cgroup else 0, int(counters.get("pids_limit_hits", 0))
        )
        exit_code = outcome.get("exit_code") if outcome else None
        sig = outcome.get("signal") if outcome else None
        data_dir = self.data_root / sid
        disk_full = await asyncio.to_thread(quota.full, data_dir)
        reason, detail = domain.classify_exit(requested, exit_code, sig, oom, pids_hits, disk_full)
        dropped = domain.log_truncation(outcome.get("logs") if outcome else None)
        if dropped:
            detail += "; " + domain.describe_truncation(dropped)
        if channel is not None:
            await channel.close()
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)
        await asyncio.to_thread(shutil.rmtree, run_dir, True)
        try:
            await asyncio.to_thread(quota.release, data_dir)
        except quota.QuotaError as exc:  # the terminal result still goes out
            log.error("sandbox %s: its disk quota could not be released: %s", sid, exc)
        self.states.remove(sid)
        if self._audit is not None and isinstance(state.get("uid"), int):
            self._audit.release_uid(state["uid"])  # (its records, if a flood hushed them)
        await asyncio.to_thread(_mark_ended, data_dir, reason, outcome)
        ready = state.get("ready") or {}
        stdout_path, stderr_path = self.log_paths(sid)
        return SandboxExited(
            sandbox_id=sid,
            exit_code=exit_code,
            signal=sig,
            reason=reason,
            detail=detail,
            started_at=ready.get("started_at", 0.0),
            ended_at=outcome.get("time", time.time()) if outcome else time.time(),
            oom_kills=oom,
            pids_limit_hits=pids_hits,
            stdout_path=str(stdout_path),
            stderr_path=str(stderr_path),
            metadata=ready.get("metadata", {}),
            disk_full=disk_full is not None,
            log_dropped_bytes=dropped,
        )

    def _remember(self, result: SandboxExited) -> None:
        self._ended[result.sandbox_id] = result
        while len(self._ended) > RECENT_RESULTS:
            self._ended.pop(next(iter(self._ended)))

    async def wait(self, sandbox_id: str) -> SandboxExited:
        """Wait for a sandbox to end (its cleanup done); returns at once if it recently ended.

        Raises:
            KeyError: the manager neither watches ``sandbox_id`` nor saw it end.
        """
        if sandbox_id in self._sandboxes:
            return await asyncio.shield(self._sandboxes[sandbox_id].exited)
        return self._ended[sandbox_id]

    async def stop(
        self, sandbox_id: str, *, reason: ExitReason = ExitReason.STOPPED, grace_s: float = 5.0
    ) -> SandboxExited:
        """SIGTERM to the workload, SIGKILL to the whole cgroup after ``grace_s``.

        Args:
            reason: ``stopped`` (a user), ``timeout`` or ``policy`` (the node agent's decision).

        Raises:
            KeyError: the manager does not watch ``sandbox_id``.
        """
        sandbox = self._sandboxes[sandbox_id]
        if sandbox.requested is None:
            sandbox.requested = reason
        with contextlib.suppress(ProcessLookupError):
            os.kill(sandbox.ready.pid, signal.SIGTERM)
        try:
            return await asyncio.wait_for(asyncio.shield(sandbox.exited), grace_s)
        except TimeoutError:
            await asyncio.to_thread(sandbox.cgroup.kill)
            return await asyncio.shield(sandbox.exited)

    # ------------------------------------------------------------------ exec

    async def exec(
        self,
        sandbox_id: str,
        argv: list[str],
        *,
        stdin: int | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
        env: dict[str, str] | None = None,
        tty: bool = False,
        transfer: dict[str, Any] | None = None,
    ) -> int:
        """Run ``argv`` inside a running sandbox with its isolation; return its exit code.

        The command joins the sandbox's namespaces and cgroups and gets the same uid, Landlock
        ruleset and seccomp filter. It does not receive the sandbox's secret variables. With
        ``tty`` its stdin (a pseudo-terminal's side) becomes its controlling terminal; with
        ``transfer`` the confined process copies files (:mod:`.transfer`) instead of running
        ``argv``.

        Raises:
            KeyError: no running sandbox ``sandbox_id``.
        """
        state = self.states.read(sandbox_id)
        if state is None or state.get("phase") != "running":
            raise KeyError(f"no running sandbox {sandbox_id}")
        exec_plan = build_exec_plan(state, argv, env)
        exec_plan["tty"] = tty
        exec_plan["transfer"] = transfer
        plan_r, plan_w = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                str(self.python),
                "-I",
                "-S",
                "-c",
                BOOTSTRAP,
                "exec",
                str(plan_r),
                "-1",
                pass_fds=(plan_r,),
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                env=_init_env(),
            )
        finally:
            os.close(plan_r)
        try:
            await asyncio.to_thread(_write_all, plan_w, marshal.dumps(exec_plan))
        finally:
            os.close(plan_w)
        return await process.wait()

    def copy_dirs(self, sandbox_id: str) -> tuple[list[str], list[str]] | None:
        """``(read, write)``: where ``dsec sandbox cp`` may copy from and to in a running
        sandbox — its ``write_allowed`` paths, and its workdir (the code) to read; None when
        it does not run."""
        state = self.states.read(sandbox_id)
        if state is None or state.get("phase") != "running":
            return None
        exec_plan = state["exec_plan"]
        internal = {*plan.DEV_WRITABLE, plan.EVENTS_TARGET}
        write = sorted({p for p in exec_plan["landlock"]["write"] if p not in internal})
        return sorted({exec_plan["cwd"], *write}), write

    # ------------------------------------------------------------------ logs

    async def follow_logs(
        self, sandbox_id: str, stream: str = "stdout", *, follow: bool = True
    ) -> AsyncIterator[str]:
        """Yield log lines; with ``follow`` keep going until the sandbox has exited."""
        path = self.log_paths(sandbox_id)[0 if stream == "stdout" else 1]
        with open(path, errors="replace") as fh:
            while True:
                line = fh.readline()
                if line:
                    yield line
                    continue
                if not follow or sandbox_id not in self._sandboxes:
                    rest = fh.read()
                    for tail in rest.splitlines(keepends=True):
                        yield tail
                    return
                await asyncio.sleep(0.05)

    async def purge(self, sandbox_id: str) -> None:
        """Delete an ended sandbox's logs and outputs.

        Raises:
            RuntimeError: the sandbox still runs.
        """
        if self.busy(sandbox_id):
            raise RuntimeError(f"sandbox {sandbox_id} still runs; stop it first")
        await asyncio.to_thread(shutil.rmtree, self.data_root / sandbox_id, True)

    def busy(self, sandbox_id: str) -> bool:
        """Whether ``sandbox_id`` is watched, being launched, or has a state file (a sandbox of
        this node whose run directory, disk quota and outputs must not be touched)."""
        return (
            sandbox_id in self._sandboxes
            or sandbox_id in self._launching
            or self.states.exists(sandbox_id)
        )

    # ------------------------------------------------------------------ restart

    async def reconcile(self) -> ReconcileReport:
        """After a node-agent restart: re-adopt live sandboxes, clean up ended or half-made ones.

        Call once at start, before launching anything. Ended sandboxes' results are returned and
        also passed to ``on_exit``.
        """
        adopted: list[str] = []
        cleaned: list[SandboxExited] = []
        self.unwatched_marker.unlink(missing_ok=True)
        for sid in self.states.ids():
            if sid in self._sandboxes:
                continue
            state = self.states.read(sid)
            if state is None:
                continue
            cgroup = (
                cgroups.SandboxCgroup.from_state(state["cgroup"]) if state.get("cgroup") else None
            )
            alive = state.get("phase") == "running" and is_alive(
                state["supervisor_pid"], state.get("supervisor_start")
            )
            if alive and cgroup is not None:
                ready = SandboxReady.model_validate(state["ready"])
                self._adopt_agent(state, ready.uid)
                self._uid_owners[ready.uid] = sid
                self._watch_landlock()
                refusals = self._report_refusals(sid, state["supervisor_pid"])
                self._watch(Sandbox(sid, ready, state, cgroup, refusals=refusals))
                adopted.append(sid)
                continue
            result = await self._finish(state, cgroup, None, None)
            self._remember(result)
            cleaned.append(result)
            if self.on_exit is not None:
                await self.on_exit(result)
        await asyncio.to_thread(self._release_stray_quotas)
        # Images a node agent that died had mounted ahead for its next starts: unmounted (their
        # loop devices freed) and deleted; the pool fills again after the first start.
        await asyncio.to_thread(self._images.clear)
        # (a node agent that died while a sandbox arrived by CRIU left its root-group bound on
        # the loop device its quota had, now free)
        await asyncio.to_thread(cgroups.clear_detached_root_io, self._hierarchy_now())
        return ReconcileReport(adopted, cleaned)

    def _release_stray_quotas(self) -> None:
        """Unmount quota filesystems no state file accounts for (an agent that died between
        mounting one and recording the sandbox's start)."""
        if not self.data_root.is_dir():
            return
        for data_dir in self.data_root.iterdir():
            sid = data_dir.name
            if self.busy(sid):
                continue
            if quota.is_mounted(data_dir):
                log.warning("releasing the disk quota of %s: no sandbox state records it", sid)
                try:
                    quota.release(data_dir)
                except quota.QuotaError as exc:
                    log.error("cannot release the disk quota of %s: %s", sid, exc)

    def _adopt_agent(self, state: dict[str, Any], uid: int) -> None:
        """Know a re-adopted sandbox's identity again; show it the (new) broker socket."""
        if not state.get("agent"):
            return
        self._agents[state["sandbox_id"]] = (uid, AgentIdentity.model_validate(state["agent"]))
        ipc_dir = Path(state["run_dir"]) / "ipc"
        if self.ipc_socket is not None and ipc_dir.is_dir():
            self._link_ipc(ipc_dir)

    async def shutdown(self, *, stop_sandboxes: bool = False) -> None:
        """Stop watching (sandboxes keep running for the next :meth:`reconcile`), or stop all
        (at once, each cleaned up and its ``on_exit`` awaited)."""
        if stop_sandboxes:
            sandboxes = list(self._sandboxes.values())
            await asyncio.gather(
                *(self.stop(s.config_id, grace_s=1.0) for s in sandboxes),
                return_exceptions=True,
            )
            monitors = [s.monitor for s in sandboxes if s.monitor is not None]
            await asyncio.gather(*monitors, return_exceptions=True)
        for sid, sandbox in list(self._sandboxes.items()):
            if sandbox.timer is not None:
                sandbox.timer.cancel()
            if sandbox.monitor is not None:
                sandbox.monitor.cancel()
            if sandbox.channel is not None:
                await sandbox.channel.close()
            if sandbox.refusals is not None:
                await sandbox.refusals.close()
            self._sandboxes.pop(sid, None)
            self._agents.pop(sid, None)
        if self._audit is not None:
            await self._audit.close()
            self._audit = None
        self._closing = True
        for timer in (self._shell_timer, self._image_timer):
            if timer is not None:
                timer.cancel()
        self._shell_timer = self._image_timer = None
        shell, self._shell = self._shell, None
        if shell is not None:  # its child and init exit at the EOF
            await shell.discard()
        if self.zygote is not None:
            await self.zygote.close()
        if self._image_fill is not None:  # a few ms of mkfs: let it finish, leave no staging
            await asyncio.gather(self._image_fill, return_exceptions=True)
        # The images mounted ahead for the next starts: no loop device, mount or file stays.
        await asyncio.to_thread(self._images.clear)
        if self.states.ids():  # sandboxes keep running, unwatched: they reap their own cgroups
            self.unwatched_marker.parent.mkdir(parents=True, exist_ok=True)
            self.unwatched_marker.write_text("no node agent watches these sandboxes\n")
        elif stop_sandboxes:  # `dsec down`: the node's cgroup parent goes too
            with contextlib.suppress(cgroups.CgroupError, OSError):
                cgroups.remove_node_group(self._hierarchy or cgroups.detect(), self.node_id)


SHARED_KEPT = 32
"""Runtimes whose last shared layout entries a node agent keeps for the next launch."""


def _runtime_key(config: SandboxConfig) -> tuple[str, ...]:
    """What a plan's shared layout entries depend on (its runtime view's inputs)."""
    extra = (str(config.env_dir), *map(str, config.extra_ro_paths))
    return (str(config.runtime), str(config.agent is not None), *extra)


def _shared_entries(the_plan: dict[str, Any]) -> bytes:
    """The plan's shared layout entries (``plan["shared"]``), marshalled for the next init."""
    layout = the_plan["layout"]
    return marshal.dumps([layout[index] for index in the_plan.get("shared", ())])


def sdk_packages() -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """Host directories of the SDK (``dsec_sdk``) and of the packages it needs (``msgpack``,
    ``msgspec``, ``blake3`` for the state plane's content hashes, ``tenacity`` for the tool
    pipeline's retries).

    They come from the node agent's own environment, built for the same interpreter the
    sandbox runs, so the compiled parts (msgspec, the SDK's ring extension) load there too.
    """
    import blake3
    import dsec_sdk
    import msgpack
    import msgspec
    import tenacity

    return (Path(dsec_sdk.__file__).resolve().parent,), tuple(
        Path(str(module.__file__)).resolve().parent
        for module in (msgpack, msgspec, blake3, tenacity)
    )


def build_exec_plan(
    state: dict[str, Any], argv: list[str], env: dict[str, str] | None
) -> dict[str, Any]:
    """The ``exec`` plan for a running sandbox, from its state file (no secrets there)."""
    exec_plan = dict(state["exec_plan"])
    exec_plan["join_pid"] = state["init_pid"]
    first, *rest = argv
    if first in ("python", "python3"):
        first = exec_plan["python"]
    exec_plan["argv"] = [first, *rest]
    exec_plan["env"] = {**exec_plan["env"], **(env or {})}
    return exec_plan


def _identity(path: Path) -> tuple[int, int, int]:
    """``(device, inode, mtime)`` of what ``path`` points to (a missing path: zeros)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (0, 0, 0)
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


async def _settled(task: asyncio.Future[None] | None) -> None:
    """Wait for ``task`` to end (its outcome is the caller's no more): a start that failed
    elsewhere must not release its disk quota while the mount is still being made."""
    if task is None or task.cancelled():
        return
    with contextlib.suppress(Exception):
        await asyncio.shield(task)  # a worker thread's mount cannot be cancelled midway


def _compile_sandbox_site() -> None:
    """Bring the bytecode of the in-sandbox ``usercustomize`` up to date (once per manager).

    Sandboxes see that directory read-only: with a stale or missing ``.pyc`` every sandboxed
    interpreter would compile the semantic layer again at its start (milliseconds each). An
    installed package has it compiled already; this covers a source tree edited since.
    """
    import compileall

    try:
        compileall.compile_dir(site_dir(), quiet=2, legacy=False)
    except OSError as exc:  # a read-only install: its bytecode came with it
        log.debug("cannot compile %s: %s", site_dir(), exc)


def _init_env() -> dict[str, str]:
    # The pre-exec stage must not inherit the node agent's environment (tokens, endpoints):
    # pid 1 of the sandbox is forked from it.
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


async def _read_reports(fd: int, timeout_s: float) -> tuple[list[dict[str, Any]], int]:
    """Read the report lines until EOF (the workload's execve closed the pipe).

    Read by the event loop itself (the pipe is non-blocking): the EOF that makes a sandbox ready
    is seen at the loop's next poll, without a worker thread's hand-off on the way.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    chunks: list[bytes] = []

    def readable() -> None:
        try:
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        except BlockingIOError:
            return
        except OSError as exc:
            if not done.done():
                done.set_exception(exc)
            return
        if not done.done():
            done.set_result(time.monotonic_ns())

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
    try:
        eof_ns = await asyncio.wait_for(done, timeout_s)
    except TimeoutError as exc:
        raise SandboxStartError("?", "spawn", f"no ready signal within {timeout_s}s") from exc
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return _parse_reports(b"".join(chunks)), eof_ns


def _parse_reports(data: bytes) -> list[dict[str, Any]]:
    """The report lines' records: JSON from a zygote's sandbox, Python literals from a pre-exec
    stage started as a fresh interpreter (see ``init._Reporter``); a line that is neither, or
    not a mapping, is skipped."""
    records = []
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError, SyntaxError, RecursionError, MemoryError):
            # (literal_eval: literals only, nothing is executed; a line nested past the stack
            # raises RecursionError or MemoryError: skipped like any other malformed line)
            record = json.loads(line) if line.startswith('{"') else ast.literal_eval(line)
            if isinstance(record, dict):
                records.append(record)
    return records


async def _wait_pid(pid: int, start_time: int | None) -> None:
    """Wait for a process that is not our child (an adopted supervisor)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    if not is_alive(pid, start_time):
        os.close(pidfd)
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def _mark_ended(data_dir: Path, reason: ExitReason, outcome: dict[str, Any] | None) -> None:
    if not data_dir.is_dir():
        return
    record = {"reason": reason.value, "ended_at": time.time()}
    if outcome and "exit_code" in outcome:
        record["exit_code"] = outcome["exit_code"]
    tmp = data_dir / f".{ENDED_MARK}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, data_dir / ENDED_MARK)  # what retention (dsec_core.retention) may remove


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "the pre-exec stage died without a report"
    return text[-limit:].strip() or "the pre-exec stage died without a report"
