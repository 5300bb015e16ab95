"""EgressController: the node agent's one entry point to egress enforcement.

Lifecycle of a sandbox (the sandbox layer calls these around its own steps)::

    await egress.attach(cgroup_dir, plan)   # after the cgroup exists, before the child joins it
    ...                                     # sandbox runs; verdicts stream from egress.events()
    await egress.detach(cgroup_dir)         # after the child exited, before the cgroup is removed

Fail-closed: `close()` (or the agent dying) leaves the programs attached and the maps pinned, so
a sandbox keeps its policy; DNS then gets no answer until a new agent runs `reconcile()`, which
re-adopts every sandbox still alive (same maps, DNS listeners restarted on the same ports) and
removes what belongs to cgroups that are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import dns.rcode
from prometheus_client import Counter

from dsec_nodeagent.dns.policy import DnsBounds
from dsec_nodeagent.dns.proxy import DnsProxy, proxy_port_range
from dsec_nodeagent.dns.upstream import UPSTREAM_ENV, UpstreamClient, parse_upstream
from dsec_nodeagent.ebpf.domain import (
    DOH_ADDRESSES,
    bucket_specs,
    cidr_entries,
    parse_networks,
)
from dsec_nodeagent.ebpf.kernel import DEFAULT_SANDBOX_SOCKETS, EgressKernel, RawEvent
from dsec_nodeagent.ebpf.model import EgressPlan, Hook, Verdict, VerdictEvent
from dsec_nodeagent.stackdeny import local_addresses

log = logging.getLogger(__name__)

DEFAULT_PIN_DIR = Path("/sys/fs/bpf/dsec/egress")
DEFAULT_STATE_DIR = Path("/run/dsec/egress")
_PROTOCOLS = {6: "tcp", 17: "udp"}
RING_BATCH = 64
"""Verdict events read from the ring buffer per :data:`RING_SLICE_S` (1,280/s at most)."""
RING_SLICE_S = 0.05
RING_PAUSES = Counter(
    "dsec_egress_ring_pauses_total",
    "Times the verdict reader spent its budget and left the ring buffer alone until the next "
    "slice (a flood; the kernel then drops events it cannot buffer; its per-rule counters, "
    "which the summaries use, still count every verdict)",
)


def without_private(plan: EgressPlan) -> EgressPlan:
    """``plan`` without its private listeners and the loopback grants that reach them."""
    private = set(plan.private_ports)
    rules = tuple(
        r
        for r in plan.rules
        if not (
            r.cidr is not None
            and r.cidr.prefixlen == r.cidr.max_prefixlen
            and r.cidr.network_address.is_loopback
            and r.ports
            and set(r.ports) <= private
        )
    )
    return plan.model_copy(update={"rules": rules, "private_ports": ()})


@dataclass(frozen=True, slots=True)
class AttachedSandbox:
    """A sandbox cgroup under enforcement."""

    sandbox_id: str
    cgroup_path: Path
    cgroup_id: int
    dns_port: int
    plan: EgressPlan


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    """What `reconcile` found: sandboxes re-adopted and cgroup ids cleaned away."""

    adopted: tuple[str, ...]
    removed: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CounterSample:
    """Kernel counter of one (sandbox, rule, verdict)."""

    cgroup_id: int
    sandbox_id: str | None
    rule_id: str | None
    verdict: Verdict
    count: int


def cgroup_id_of(cgroup_path: Path) -> int:
    """The id the kernel reports for a cgroup v2 directory (its inode number).

    Raises:
        ValueError: when the path is not a cgroup v2 directory.
    """
    if not (cgroup_path / "cgroup.controllers").exists():
        raise ValueError(
            f"cgroup_path {cgroup_path}: not a cgroup v2 directory (expected a directory under the "
            "cgroup2 mount, e.g. /sys/fs/cgroup/unified/...)"
        )
    return os.stat(cgroup_path).st_ino


def _resolve_upstream(value: str | None) -> tuple[str, int]:
    text = value or os.environ.get(UPSTREAM_ENV)
    if text:
        return parse_upstream(text)
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                log.info(
                    "%s unset: using nameserver %s from /etc/resolv.conf", UPSTREAM_ENV, parts[1]
                )
                return parse_upstream(parts[1])
    raise ValueError(f"{UPSTREAM_ENV} is not set and /etc/resolv.conf names no nameserver")


class EventStream:
    """A subscription to verdict events (an async iterator), registered when created."""

    def __init__(self, registry: set[asyncio.Queue[VerdictEvent]], size: int) -> None:
        self.queue: asyncio.Queue[VerdictEvent] = asyncio.Queue(size)
        self._registry = registry

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> VerdictEvent:
        return await self.queue.get()

    async def next(self, timeout: float | None = None) -> VerdictEvent:
        """The next event (raises TimeoutError after ``timeout`` seconds)."""
        return await asyncio.wait_for(self.queue.get(), timeout)

    def close(self) -> None:
        """Unsubscribe."""
        self._registry.discard(self.queue)

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EgressController:
    """Kernel hooks + DNS proxy + verdict stream for every sandbox on this node."""

    def __init__(
        self,
        *,
        dns_upstream: str | None = None,
        pin_dir: Path = DEFAULT_PIN_DIR,
        state_dir: Path = DEFAULT_STATE_DIR,
        deny_rcode: str = "NXDOMAIN",
        ttl_grace_s: float = 2.0,
        proxy_host4: str = "127.0.0.1",
        proxy_host6: str = "::1",
        sweep_interval_s: float = 30.0,
        event_queue_size: int = 10000,
        extra_doh_addresses: Iterable[str] = (),
        dns_bounds: DnsBounds | None = None,
        protected_addresses: Iterable[str] | None = None,
        trusted_targets: str = "",
        max_sandbox_sockets: int = DEFAULT_SANDBOX_SOCKETS,
    ) -> None:
        """Configure (nothing touches the kernel until `start`).

        Args:
            dns_upstream: ``host:port`` of the upstream resolver; default ``DSEC_DNS_UPSTREAM``,
                then the first nameserver of /etc/resolv.conf.
            pin_dir: where the maps are pinned (bpffs).
            state_dir: where each sandbox's plan and DNS port are kept for `reconcile`.
            deny_rcode: ``NXDOMAIN`` or ``REFUSED`` for names no rule allows.
            ttl_grace_s: seconds an answered address stays open past its DNS TTL.
            proxy_host4: IPv4 address of the DNS listeners (loopback).
            proxy_host6: IPv6 address of the DNS listeners (loopback).
            sweep_interval_s: how often expired DNS grants are deleted from the maps.
            event_queue_size: per-subscriber buffer; the oldest events drop when it is full.
            extra_doh_addresses: DoH/DoT resolver addresses to block besides the well-known ones.
            dns_bounds: TTL cap, per-sandbox allow-map quota, answer size, query rate (defaults:
                the README's "Egress and DNS bounds").
            protected_addresses: addresses DNS answers may not open unless a rule sets
                ``allow_internal_only``; default every address of this node's interfaces (the
                caller adds the stack's servers).
            trusted_targets: ``DSEC_DNS_TRUSTED_TARGETS``: comma-separated addresses/networks
                DNS answers may open although they are loopback or this node's.
            max_sandbox_sockets: ``DSEC_SANDBOX_MAX_SOCKETS``: IP sockets one sandbox may hold
                (the node's sandboxes together: half of the ephemeral port range).
        """
        if deny_rcode.upper() not in ("NXDOMAIN", "REFUSED"):
            raise ValueError(f"deny_rcode: expected NXDOMAIN or REFUSED, got {deny_rcode!r}")
        self.upstream = _resolve_upstream(dns_upstream)
        doh = DOH_ADDRESSES | {ipaddress.ip_address(a) for a in extra_doh_addresses}
        bounds = dns_bounds or DnsBounds()
        ports = proxy_port_range()
        self.kernel = EgressKernel(
            pin_dir,
            doh_addresses=doh,
            max_hosts=bounds.node_capacity,
            proxy_ports=ports,
            max_sandbox_sockets=max_sandbox_sockets,
        )
        protected = (
            sorted(local_addresses()) if protected_addresses is None else protected_addresses
        )
        self.state_dir = state_dir
        self.proxy_host4 = proxy_host4
        self.proxy_host6 = proxy_host6
        self.sweep_interval_s = sweep_interval_s
        self.proxy = DnsProxy(
            UpstreamClient(*self.upstream),
            self.kernel,
            listen4=proxy_host4,
            listen6=proxy_host6,
            deny_rcode=dns.rcode.from_text(deny_rcode.upper()),
            ttl_grace_s=ttl_grace_s,
            bounds=bounds,
            protected=(ipaddress.ip_address(a) for a in protected),
            trusted=parse_networks(trusted_targets, "DSEC_DNS_TRUSTED_TARGETS"),
            ports=ports,
        )
        self._queue_size = event_queue_size
        self._sandboxes: dict[int, AttachedSandbox] = {}
        self._subscribers: set[asyncio.Queue[VerdictEvent]] = set()
        self._listeners: list[Callable[[VerdictEvent], None]] = []
        self._events_fd: int | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.dropped_events = 0
        self.ring_pauses = 0
        self._watching = False
        self._slice_start = 0.0
        self._slice_read = 0

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the programs (about a second of compiling), open the maps, read verdicts."""
        await asyncio.to_thread(self.kernel.load)
        # no listener of an earlier agent outlives it (an adopted sandbox's proxy is gone)
        self.kernel.clear_private_ports()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._events_fd = self.kernel.open_events(self._on_raw_event)
        asyncio.get_running_loop().add_reader(self._events_fd, self._read_events)
        self._watching = True
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def set_stack_deny(
        self, entries: Iterable[tuple[str, int]], *, replace: bool = True
    ) -> int:
        """Deny ``(address, port)`` to every sandbox on the node, before any allow rule
        (``replace=False``: in addition to the entries already there)."""
        parsed = [(ipaddress.ip_address(a), p) for a, p in entries]
        return await asyncio.to_thread(
            functools.partial(self.kernel.set_stack_deny, parsed, replace=replace)
        )

    async def close(self) -> None:
        """Stop answering DNS and reading events; programs and pinned maps stay (fail-closed)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._events_fd is not None:
            self.kernel.consume_events(RING_BATCH * 16)  # bounded: a flood may still go on
            if self._watching:
                asyncio.get_running_loop().remove_reader(self._events_fd)
                self._watching = False
            self._events_fd = None
        await self.proxy.close()
        self.kernel.close()
        self._sandboxes.clear()

    async def uninstall(self) -> None:
        """Detach from every sandbox, delete state and pins, close (decommissioning, tests)."""
        for sandbox in list(self._sandboxes.values()):
            await self.detach(sandbox.cgroup_path)
        await self.close()
        self.kernel.unpin()
        with contextlib.suppress(OSError):  # only when empty
            self.state_dir.rmdir()

    # --- sandboxes -------------------------------------------------------------------------

    async def attach(self, cgroup_path: Path | str, plan: EgressPlan) -> AttachedSandbox:
        """Put a cgroup under ``plan``: maps filled, DNS listening, programs attached.

        Call it before the sandbox's first instruction runs in the cgroup. On failure nothing is
        left behind.

        Raises:
            ValueError: not a cgroup v2 directory, or already attached.
            OSError: the kernel refused to attach.
        """
        if self._events_fd is None:
            raise RuntimeError("EgressController.start() has not run (or close() has)")
        path = Path(cgroup_path)
        cgid = cgroup_id_of(path)
        if cgid in self._sandboxes:
            raise ValueError(
                f"cgroup_path {path}: already attached (sandbox "
                f"{self._sandboxes[cgid].sandbox_id}); detach it first"
            )
        port = await self.proxy.serve(cgid, plan)
        try:
            self._program(cgid, plan, port)
            self.kernel.set_private_ports(cgid, plan.private_ports)
            self.kernel.attach(path)
        except BaseException:
            self.kernel.purge(cgid)
            await self.proxy.stop(cgid)
            raise
        sandbox = AttachedSandbox(plan.sandbox_id, path, cgid, port, plan)
        self._sandboxes[cgid] = sandbox
        self._save(sandbox)
        return sandbox

    def _program(self, cgid: int, plan: EgressPlan, port: int) -> None:
        self.kernel.purge(cgid)  # a recycled inode must not inherit old entries
        self.kernel.add_cidrs(cgid, cidr_entries(plan))
        self.kernel.set_buckets(cgid, bucket_specs(plan))
        self.kernel.set_sandbox(cgid, self.proxy_host4, self.proxy_host6, port, plan.log_allowed)

    async def detach(self, cgroup_path: Path | str) -> None:
        """Remove a sandbox's programs (if its cgroup still exists), entries, DNS and state."""
        path = Path(cgroup_path)
        cgid = next((c for c, s in self._sandboxes.items() if s.cgroup_path == path), None)
        if cgid is None and path.exists():
            cgid = cgroup_id_of(path)
        if cgid is None:
            return
        if path.exists():
            self.kernel.detach(path)
        self.kernel.purge(cgid)
        await self.proxy.stop(cgid)
        self._sandboxes.pop(cgid, None)
        (self.state_dir / f"{cgid}.json").unlink(missing_ok=True)

    def sandboxes(self) -> list[AttachedSandbox]:
        """Sandboxes under enforcement by this agent."""
        return list(self._sandboxes.values())

    async def reconcile(self) -> ReconcileReport:
        """Adopt the sandboxes a previous agent left attached; clean up the dead ones."""
        in_maps = set(self.kernel.sandbox_ids())
        adopted: list[str] = []
        removed: set[int] = set()
        for state_file in sorted(self.state_dir.glob("*.json")):
            try:
                record = json.loads(state_file.read_text())
                cgid, path = int(record["cgroup_id"]), Path(record["cgroup_path"])
                plan = EgressPlan.model_validate(record["plan"])
            except (ValueError, KeyError, TypeError) as exc:
                # Its cgroup (if alive) keeps the programs and, without a map entry, denies all.
                log.warning("dropping unreadable egress state %s: %s", state_file, exc)
                state_file.unlink(missing_ok=True)
                continue
            if cgid in self._sandboxes:
                continue
            alive = path.is_dir() and os.stat(path).st_ino == cgid
            if not alive or cgid not in in_maps:
                self.kernel.purge(cgid)
                state_file.unlink(missing_ok=True)
                removed.add(cgid)
                continue
            try:
                changed = self.kernel.renew(path)  # this agent's versions, hooks added since
            except OSError as exc:  # its cgroup went meanwhile: adopted as it is
                log.warning("egress: %s: programs not brought up to date: %s", plan.sandbox_id, exc)
                changed = {}
            added = sorted(n for n, how in changed.items() if how == "added")
            if added:
                log.info("egress: %s gained %s on adoption", plan.sandbox_id, ", ".join(added))
            if plan.private_ports:
                # Its HTTPS proxy went with the agent that ran it, and so does the way there:
                # that port is anyone's now (the sandbox fails closed, never reaches another's).
                plan = without_private(plan)
                self.kernel.drop_cidrs(cgid)
            port = await self.proxy.serve(cgid, plan, int(record["dns_port"]))
            self.proxy.adopt(cgid, ((a, p, e) for a, p, _, e in self.kernel.host_entries(cgid)))
            self.kernel.add_cidrs(cgid, cidr_entries(plan))  # entries of an older agent gain flags
            self.kernel.set_sandbox(
                cgid, self.proxy_host4, self.proxy_host6, port, plan.log_allowed
            )
            sandbox = AttachedSandbox(plan.sandbox_id, path, cgid, port, plan)
            self._sandboxes[cgid] = sandbox
            self._save(sandbox)
            adopted.append(plan.sandbox_id)
        for cgid in in_maps - set(self._sandboxes) - removed:
            self.kernel.purge(cgid)
            removed.add(cgid)
        return ReconcileReport(adopted=tuple(adopted), removed=tuple(sorted(removed)))

    def _save(self, sandbox: AttachedSandbox) -> None:
        record = {
            "cgroup_id": sandbox.cgroup_id,
            "cgroup_path": str(sandbox.cgroup_path),
            "dns_port": sandbox.dns_port,
            "plan": sandbox.plan.model_dump(mode="json"),
        }
        final = self.state_dir / f"{sandbox.cgroup_id}.json"
        tmp = final.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(final)

    # --- verdicts --------------------------------------------------------------------------

    def _read_events(self) -> None:
        """Read at most :data:`RING_BATCH` verdicts per :data:`RING_SLICE_S` (wake-ups of one
        slice share the budget); when the budget is spent, stop watching the ring buffer and
        read it again when the next slice begins (polling while the flood lasts). A flooding
        sandbox thus costs the node agent's loop a bounded share. What does not fit in the ring
        buffer meanwhile is dropped by the kernel; its per-rule counters still count every
        verdict (``dsec_egress_connections_total``), and the egress layer adds those to the
        ``policy.violation_summary`` counts."""
        if self._events_fd is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._slice_start >= RING_SLICE_S:
            self._slice_start, self._slice_read = now, 0
        budget = RING_BATCH - self._slice_read
        if budget > 0:
            self._slice_read += self.kernel.consume_events(budget)
        if self._slice_read < RING_BATCH:
            if not self._watching:
                loop.add_reader(self._events_fd, self._read_events)
                self._watching = True
            return
        self.ring_pauses += 1
        RING_PAUSES.inc()
        if self._watching:
            loop.remove_reader(self._events_fd)
            self._watching = False
        # Consuming needs no wake-up: the timer reads the ring buffer directly (the kernel only
        # signals a reader that has caught up).
        loop.call_at(self._slice_start + RING_SLICE_S, self._read_events)

    def _on_raw_event(self, raw: RawEvent) -> None:
        try:
            event = self._enrich(raw)
        except ValueError:  # a verdict/hook number this code does not know: skip, keep reading
            log.warning("unknown egress verdict record %s", raw)
            return
        for queue in self._subscribers:
            if queue.full():
                queue.get_nowait()
                self.dropped_events += 1
            queue.put_nowait(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("egress verdict listener failed")

    def _enrich(self, raw: RawEvent) -> VerdictEvent:
        sandbox = self._sandboxes.get(raw.cgroup_id)
        rule = sandbox.plan.rule_at(raw.rule) if sandbox else None
        return VerdictEvent(
            time_ns=raw.ts_ns,
            wall_time=time.time(),
            cgroup_id=raw.cgroup_id,
            sandbox_id=sandbox.sandbox_id if sandbox else None,
            pid=raw.pid,
            comm=raw.comm,
            verdict=Verdict(raw.verdict),
            hook=Hook(raw.hook),
            rule_id=rule.id if rule else None,
            family=raw.family,
            protocol=_PROTOCOLS.get(raw.proto, str(raw.proto)),
            address=str(raw.address),
            port=raw.port,
        )

    def add_listener(self, callback: Callable[[VerdictEvent], None]) -> None:
        """Call ``callback`` (on the event loop, must not block) for every verdict event."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[VerdictEvent], None]) -> None:
        """Stop calling ``callback``."""
        self._listeners.remove(callback)

    def events(self) -> EventStream:
        """Every verdict event from this call on (denies; allows too for ``log_allowed`` plans).

        Use as ``async for event in controller.events(): ...`` or ``with controller.events() as
        stream: event = await stream.next()``; leaving the ``with`` (or `EventStream.close`)
        unsubscribes.
        """
        stream = EventStream(self._subscribers, self._queue_size)
        self._subscribers.add(stream.queue)
        return stream

    def drain_events(self) -> None:
        """Read the ring buffer now (tests and shutdown; the loop does it on its own)."""
        self.kernel.consume_events()

    def counters(self) -> list[CounterSample]:
        """Kernel counters per (sandbox, rule, verdict) — the source of the Prometheus metric."""
        out: list[CounterSample] = []
        for (cgid, slot, verdict), count in self.kernel.counters().items():
            sandbox = self._sandboxes.get(cgid)
            rule = sandbox.plan.rule_at(slot) if sandbox else None
            out.append(
                CounterSample(
                    cgid,
                    sandbox.sandbox_id if sandbox else None,
                    rule.id if rule else None,
                    Verdict(verdict),
                    count,
                )
            )
        return out

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                self.proxy.expire()  # frees quotas
                self.kernel.sweep(time.monotonic_ns())
            except Exception:
                log.exception("sweeping expired DNS grants failed")
