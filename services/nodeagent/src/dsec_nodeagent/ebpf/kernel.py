"""Kernel adapter: compile egress.bpf.c with BCC, attach it to cgroups, write its pinned maps.

Every map is pinned under ``pin_dir`` (BPF_TABLE_PINNED creates the pin on first load and opens
it on later loads), so a restarted agent compiles the same source and gets the *same* maps: the
programs its predecessor attached keep working with what the new agent writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec_nodeagent.ebpf import libbpf
from dsec_nodeagent.ebpf.domain import DOH_ADDRESSES, BucketSpec, CidrEntry
from dsec_nodeagent.ebpf.model import IPAddress

if TYPE_CHECKING:  # dns imports ebpf's pure modules; keep the import graph one-way at run time
    from dsec_nodeagent.dns.proxy import Grant

SOURCE = Path(__file__).with_name("egress.bpf.c")
BPFFS = Path("/sys/fs/bpf")

# program name -> BPFAttachType (UAPI enum bpf_attach_type)
ATTACH_TYPES: dict[str, int] = {
    "ingress": 0,  # BPF_CGROUP_INET_INGRESS (a cgroup_skb program, PROGRAM_TYPES)
    "bind4": 8,
    "bind6": 9,
    "connect4": 10,
    "connect6": 11,
    "sendmsg4": 14,
    "sendmsg6": 15,
    "recvmsg4": 19,
    "recvmsg6": 20,
    "getpeername4": 29,
    "getpeername6": 30,
    "sockopt": 22,  # BPF_CGROUP_SETSOCKOPT (a cgroup_sockopt program, PROGRAM_TYPES)
    # (release and state before create: a socket counted is never released, nor put in
    # TIME_WAIT, uncounted)
    "sock_release": 34,  # BPF_CGROUP_INET_SOCK_RELEASE (cgroup_sock, PROGRAM_TYPES)
    "sock_state": 3,  # BPF_CGROUP_SOCK_OPS (a sock_ops program, PROGRAM_TYPES)
    "sock_create": 2,  # BPF_CGROUP_INET_SOCK_CREATE (cgroup_sock, PROGRAM_TYPES)
}
MAP_NAMES = (
    "sandboxes",
    "cidr4",
    "cidr6",
    "host4",
    "host6",
    "buckets",
    "counters",
    "dns_dst",
    "udp_peers",
    "doh",
    "stack_deny",
    "dns_ports",
    "private_ports",
    "sock_use",
    "sock_hold",
    "sock_link",
    "listen_use",
    "events",
)
_PER_CGROUP_MAPS = ("cidr4", "cidr6", "host4", "host6", "buckets", "counters")
BPF_PROG_TYPE_CGROUP_SOCK_ADDR = 18
BPF_PROG_TYPE_CGROUP_SKB = 8
BPF_PROG_TYPE_CGROUP_SOCKOPT = 25
BPF_PROG_TYPE_CGROUP_SOCK = 9
BPF_PROG_TYPE_SOCK_OPS = 13
PROGRAM_TYPES: dict[str, int] = {
    "ingress": BPF_PROG_TYPE_CGROUP_SKB,
    "sockopt": BPF_PROG_TYPE_CGROUP_SOCKOPT,
    "sock_release": BPF_PROG_TYPE_CGROUP_SOCK,
    "sock_create": BPF_PROG_TYPE_CGROUP_SOCK,
    "sock_state": BPF_PROG_TYPE_SOCK_OPS,
}
"""A program's type where it is not a sock_addr hook."""
FOLLOWERS = ("sock_release", "sock_state")
"""Programs that stay on a sandbox's cgroup when it is detached, until the cgroup goes: its
sockets still closing (an orphaned FIN_WAIT, a connection in TIME_WAIT) give their places
back to the node's count only through them (detached, the node's count kept them for ever)."""
DEFAULT_SANDBOX_SOCKETS = 4096
"""IP sockets one sandbox may hold (``DSEC_SANDBOX_MAX_SOCKETS``)."""


def node_socket_bound(
    ephemeral: Path = Path("/proc/sys/net/ipv4/ip_local_port_range"),
) -> int:
    """IP sockets the node's sandboxes may hold together: half of the kernel's ephemeral port
    range (each socket takes at most one port of the host's network, which sandboxes share), so
    the host always keeps the other half to connect and send from."""
    try:
        low, high = (int(v) for v in ephemeral.read_text().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999  # the kernel's default range
    return max(64, (high - low + 1) // 2)


AF_HOST_EXACT = 1
_TRANSPORTS = 2 | 4  # AF_TCP | AF_UDP
SF_LOG_ALLOWED = 1
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_./-]+\Z")


class EgressUnavailable(RuntimeError):
    """The kernel side cannot be set up here (no BCC, no headers, no bpffs, not root)."""


@dataclass(frozen=True, slots=True)
class RawEvent:
    """A verdict record as the kernel wrote it (see struct verdict_event)."""

    ts_ns: int
    cgroup_id: int
    pid: int
    rule: int
    verdict: int
    hook: int
    family: int
    proto: int
    port: int
    address: IPAddress
    comm: str


def _be32_words(packed: bytes) -> list[int]:
    """Network-order bytes as u32 words whose in-memory bytes stay in network order."""
    return [int.from_bytes(packed[i : i + 4], sys.byteorder) for i in range(0, len(packed), 4)]


def _words_bytes(words: Iterable[int]) -> bytes:
    return b"".join(int(w).to_bytes(4, sys.byteorder) for w in words)


def _htons(port: int) -> int:
    return int.from_bytes(port.to_bytes(2, "big"), sys.byteorder)


def ensure_bpffs() -> None:
    """Mount bpffs at /sys/fs/bpf when nothing is mounted there (pins need it)."""
    if os.path.ismount(BPFFS) and _fs_type(BPFFS) == "bpf":
        return
    try:
        subprocess.run(
            ["mount", "-t", "bpf", "bpf", str(BPFFS)], check=True, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise EgressUnavailable(f"cannot mount bpffs at {BPFFS}: {detail.strip()}") from exc


def _fs_type(path: Path) -> str | None:
    """File system type of the topmost mount at exactly ``path``."""
    found = None
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[1] == str(path):
            found = parts[2]
    return found


def _bcc() -> Any:
    try:
        import bcc
    except ImportError as exc:
        raise EgressUnavailable(
            "BCC is not importable: install python3-bpfcc and run scripts/setup-kernel.sh"
        ) from exc
    return bcc


_MADV_PAGEOUT = 21
_COMPILER_LIBS = re.compile(r"lib(LLVM|clang|bcc)")


def release_compiler_memory() -> None:
    """Give back what compiling cost: the node agent stays a small idle process.

    BCC compiles once at start; LLVM's heap and the pages of libLLVM/libclang it touched would
    otherwise stay resident (about 100 MB). Freed heap goes back with ``malloc_trim``; the
    compiler's file-backed pages are paged out with ``MADV_PAGEOUT`` (clean pages, reloaded
    from the library file should BCC ever need them again).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.malloc_trim(0)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and _COMPILER_LIBS.search(fields[5]):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                libc.madvise(start, end - start, _MADV_PAGEOUT)  # best effort: 0 or EINVAL


class EgressKernel:
    """One loaded copy of the egress programs and typed access to their pinned maps."""

    def __init__(
        self,
        pin_dir: Path,
        *,
        max_cidrs: int = 262144,
        max_hosts: int = 65536,
        ringbuf_pages: int = 64,
        doh_addresses: Iterable[IPAddress] = DOH_ADDRESSES,
        proxy_ports: tuple[int, int] | None = None,
        max_sandbox_sockets: int = DEFAULT_SANDBOX_SOCKETS,
    ) -> None:
        if not _SAFE_PATH.match(str(pin_dir)) or not str(pin_dir).startswith(str(BPFFS) + "/"):
            raise ValueError(f"pin_dir {pin_dir}: expected a plain path under {BPFFS}/")
        self.pin_dir = pin_dir
        lo, hi = proxy_ports or (0, 0)
        self._defines = {
            "MAX_CIDRS": max_cidrs,
            "MAX_HOSTS": max_hosts,
            "RINGBUF_PAGES": ringbuf_pages,
            "PROXY_PORT_LO": lo,  # the DNS proxy's ports: no sandbox binds one (0: none)
            "PROXY_PORT_HI": hi,
            "MAX_NODE_SOCKETS": (node := node_socket_bound()),
            "MAX_SANDBOX_SOCKETS": min(max_sandbox_sockets, node),
        }
        self._doh = frozenset(doh_addresses)
        self._bpf: Any = None
        self._budget = 0
        self._fns: dict[str, Any] = {}
        self._ids: dict[str, int] = {}  # each loaded program's kernel id (renew compares them)
        self._sandboxes_map_id = 0

    # --- loading ---------------------------------------------------------------------------

    def load(self) -> None:
        """Compile and load the programs; create or re-open the pinned maps."""
        if os.geteuid() != 0:
            raise EgressUnavailable("egress enforcement needs root (CAP_BPF, CAP_NET_ADMIN)")
        bcc = _bcc()
        ensure_bpffs()
        self.pin_dir.mkdir(parents=True, exist_ok=True)
        cflags = [f'-DPIN_DIR="{self.pin_dir}"', "-Wno-unused-function"]
        cflags += [f"-D{k}={v}" for k, v in self._defines.items()]
        try:
            self._bpf = bcc.BPF(src_file=str(SOURCE).encode(), cflags=cflags)
            for name in ATTACH_TYPES:
                kind = PROGRAM_TYPES.get(name, BPF_PROG_TYPE_CGROUP_SOCK_ADDR)
                self._fns[name] = self._bpf.load_func(name.encode(), kind, None, ATTACH_TYPES[name])
                self._ids[name] = libbpf.prog_id(self._fns[name].fd)
        except Exception as exc:
            self.close()
            raise EgressUnavailable(
                f"loading {SOURCE.name} failed ({exc}); kernel headers and BCC come from "
                "scripts/setup-kernel.sh"
            ) from exc
        self._sandboxes_map_id = libbpf.map_id(self._table("sandboxes").map_fd)
        self._load_doh()
        release_compiler_memory()

    def close(self) -> None:
        """Close our file descriptors. Attached programs and pinned maps stay (fail-closed)."""
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None
        self._fns.clear()
        self._ids.clear()

    def unpin(self) -> None:
        """Remove every pin (maps die once no attached program uses them)."""
        if self.pin_dir.exists():
            shutil.rmtree(self.pin_dir)
        if self.pin_dir.parent != BPFFS:
            with contextlib.suppress(OSError):  # only when empty
                self.pin_dir.parent.rmdir()

    def _table(self, name: str) -> Any:
        if self._bpf is None:
            raise RuntimeError("EgressKernel.load() has not run")
        return self._bpf[name.encode()]

    def _load_doh(self) -> None:
        table = self._table("doh")
        for address in self._doh:
            key = table.Key()
            packed = (
                ipaddress.IPv6Address(b"\0" * 12 + address.packed)
                if address.version == 4
                else address
            ).packed
            key.addr[:] = _be32_words(packed)
            table[key] = table.Leaf(1)

    def set_stack_deny(
        self, entries: Iterable[tuple[IPAddress, int]], *, replace: bool = True
    ) -> int:
        """Set the node-wide deny set (the stack's own servers); return how many entries
        ``entries`` gave. ``replace=False`` adds to what is there (agents sharing the pins).

        Checked before any allow entry, so no sandbox rule can open these ``(address, port)``.
        """
        table = self._table("stack_deny")
        wanted = {}
        for address, port in entries:
            key = table.Key()
            packed = (
                ipaddress.IPv6Address(b"\0" * 12 + address.packed)
                if address.version == 4
                else address
            ).packed
            key.addr[:] = _be32_words(packed)
            key.port = port
            wanted[(bytes(packed), port)] = key
        for key in list(table.keys()) if replace else []:
            if (_words_bytes(key.addr), int(key.port)) not in wanted:
                with contextlib.suppress(KeyError):
                    del table[key]
        for key in wanted.values():
            table[key] = table.Leaf(1)
        return len(wanted)

    # --- cgroups ---------------------------------------------------------------------------

    def attach(self, cgroup_dir: Path) -> None:
        """Attach every program (BPF_F_ALLOW_MULTI: a parent's programs still run too)."""
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        done: list[str] = []
        try:
            for name, attach_type in ATTACH_TYPES.items():
                if name in FOLLOWERS:  # (one left by a detach here: kept, or replaced by ours)
                    if self._renew_one(fd, name, attach_type) == "added":
                        done.append(name)
                    continue
                self._bpf.attach_func(self._fns[name], fd, attach_type, libbpf.BPF_F_ALLOW_MULTI)
                done.append(name)
        except Exception as exc:
            for name in done:
                self._bpf.detach_func(self._fns[name], fd, ATTACH_TYPES[name])
            raise OSError(f"attaching egress programs to {cgroup_dir}: {exc}") from exc
        finally:
            os.close(fd)

    def renew(self, cgroup_dir: Path) -> dict[str, str]:
        """Bring the programs of a sandbox adopted from an earlier agent to this agent's own
        versions: a program none of whose versions is attached (the sandbox started before it
        existed) is attached; a version another agent loaded is replaced in place, atomically
        (its fixes reach sandboxes already running, with no moment under neither or both); a
        second copy of ours is detached. Each kind is tried whatever another's outcome.

        Returns ``{program name: "added" | "replaced"}`` for what changed.

        Raises:
            OSError: some kind could not be brought up to date (each named; the others were).
        """
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        changed: dict[str, str] = {}
        failed: list[str] = []
        try:
            # the ingress program last: it reads what the new sock_addr hooks remember
            for name, attach_type in sorted(ATTACH_TYPES.items(), key=lambda t: t[0] == "ingress"):
                try:
                    how = self._renew_one(fd, name, attach_type)
                except Exception as exc:  # (BCC's attach raises Exception)
                    failed.append(f"{name}: {exc}")
                    continue
                if how:
                    changed[name] = how
        finally:
            os.close(fd)
        if failed:
            raise OSError(f"renewing programs of {cgroup_dir}: {'; '.join(failed)}")
        return changed

    def _renew_one(self, fd: int, name: str, attach_type: int) -> str | None:
        fn = self._fns[name]
        own = self._ids[name]
        attached = libbpf.attached_prog_ids(fd, attach_type)
        older = [p for p in attached if p != own and self._ours(p)]
        how = None
        if own not in attached:
            if older:
                libbpf.replace_prog(fd, attach_type, fn.fd, older.pop(0))
                how = "replaced"
            else:
                self._bpf.attach_func(fn, fd, attach_type, libbpf.BPF_F_ALLOW_MULTI)
                how = "added"
        for extra in older:  # a copy beside ours would run twice
            try:
                libbpf.detach_prog_id(fd, attach_type, extra)
            except OSError as exc:
                if exc.errno != errno.ENOENT:  # (another agent detached it first)
                    raise
        return how

    def _ours(self, prog_id: int) -> bool:
        """Whether a program uses this instance's pinned ``sandboxes`` map (False: gone)."""
        try:
            return self._sandboxes_map_id in libbpf.prog_map_ids(prog_id)[1]
        except OSError:  # detached and freed meanwhile
            return False

    def detach(self, cgroup_dir: Path, *, followers: bool = False) -> int:
        """Detach our programs — also those a previous agent attached — and return how many.
        The :data:`FOLLOWERS` stay (they go with the cgroup) unless ``followers``.

        "Ours" means: the program uses this instance's pinned ``sandboxes`` map.
        """
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        count = 0
        try:
            for name, attach_type in ATTACH_TYPES.items():
                if name in FOLLOWERS and not followers:
                    continue
                for prog_id in libbpf.attached_prog_ids(fd, attach_type):
                    if self._ours(prog_id):
                        libbpf.detach_prog_id(fd, attach_type, prog_id)
                        count += 1
        finally:
            os.close(fd)
        return count

    def own_program_ids(self) -> set[int]:
        """The kernel ids of this instance's programs."""
        return set(self._ids.values())

    def attached_ids(self, cgroup_dir: Path) -> set[int]:
        """The ids of every program attached to a cgroup for the attach types we use."""
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return {p for t in ATTACH_TYPES.values() for p in libbpf.attached_prog_ids(fd, t)}
        finally:
            os.close(fd)

    def attached_count(self, cgroup_dir: Path) -> int:
        """How many of our programs are attached to a cgroup."""
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return sum(
                self._ours(prog_id)
                for attach_type in ATTACH_TYPES.values()
                for prog_id in libbpf.attached_prog_ids(fd, attach_type)
            )
        finally:
            os.close(fd)

    # --- maps ------------------------------------------------------------------------------

    def set_sandbox(
        self, cgroup_id: int, proxy4: str, proxy6: str, port: int, log_allowed: bool
    ) -> None:
        """Register a cgroup: where its DNS goes and how loud it is."""
        table = self._table("sandboxes")
        leaf = table.Leaf()
        leaf.proxy4 = _be32_words(ipaddress.IPv4Address(proxy4).packed)[0]
        leaf.proxy6[:] = _be32_words(ipaddress.IPv6Address(proxy6).packed)
        leaf.proxy_port = _htons(port)
        leaf.flags = SF_LOG_ALLOWED if log_allowed else 0
        table[ctypes.c_uint64(cgroup_id)] = leaf
        # no sandbox may bind its DNS proxy's port, also while this agent is down (pinned)
        self._table("dns_ports")[ctypes.c_uint32(port)] = ctypes.c_uint32(1)

    def sandbox_ids(self) -> list[int]:
        """Cgroup ids registered in the pinned map (those a restarted agent must adopt)."""
        return [int(k.value) for k in self._table("sandboxes")]

    def add_cidrs(self, cgroup_id: int, entries: Iterable[CidrEntry]) -> None:
        """Write ``cidr`` rule entries into the tries."""
        t4, t6 = self._table("cidr4"), self._table("cidr6")
        for entry in entries:
            net = entry.network
            table = t4 if net.version == 4 else t6
            key = table.Key()
            key.prefixlen = 64 + 16 + net.prefixlen
            key.cgid = cgroup_id
            key.port = entry.port
            words = _be32_words(net.network_address.packed)
            if net.version == 4:
                key.addr = words[0]
            else:
                key.addr[:] = words
            old = table.get(key)
            flags = entry.transports | (AF_HOST_EXACT if entry.host_exact else 0)
            if old is not None:  # two rules, one range: the union of their transports
                flags |= int(old.flags) & _TRANSPORTS
            table[key] = table.Leaf(rule=entry.slot, flags=flags, expires_ns=0)

    def set_buckets(self, cgroup_id: int, specs: Iterable[BucketSpec]) -> None:
        """Create (full) connection buckets for rate-limited rules."""
        table = self._table("buckets")
        for spec in specs:
            key = table.Key(cgid=cgroup_id, rule=spec.slot, pad=0)
            leaf = table.Leaf()
            leaf.tat = 0
            leaf.interval_ns = spec.interval_ns
            leaf.tau_ns = spec.tau_ns
            table[key] = leaf

    def grant(self, cgroup_id: int, grants: Sequence[Grant]) -> None:
        """Open answered addresses until their expiry (the DNS proxy's sink).

        An address already open keeps the later of the two expiries.
        """
        t4, t6 = self._table("host4"), self._table("host6")
        for g in grants:
            table = t4 if g.address.version == 4 else t6
            key = table.Key()
            key.cgid = cgroup_id
            key.port = g.port
            words = _be32_words(g.address.packed)
            if g.address.version == 4:
                key.addr = words[0]
            else:
                key.addr[:] = words
            old = table.get(key)
            expires, flags = g.expires_ns, AF_HOST_EXACT | g.transports
            if old is not None:
                expires = max(int(old.expires_ns), g.expires_ns)
                flags |= int(old.flags) & _TRANSPORTS
            table[key] = table.Leaf(rule=g.slot, flags=flags, expires_ns=expires)

    def revoke(self, cgroup_id: int, keys: Sequence[tuple[IPAddress, int]]) -> None:
        """Delete DNS grants ``(address, port)`` of a cgroup (expired: their quota is free)."""
        t4, t6 = self._table("host4"), self._table("host6")
        for address, port in keys:
            table = t4 if address.version == 4 else t6
            key = table.Key()
            key.cgid = cgroup_id
            key.port = port
            words = _be32_words(address.packed)
            if address.version == 4:
                key.addr = words[0]
            else:
                key.addr[:] = words
            table.pop(key, None)

    def set_private_ports(self, cgroup_id: int, ports: Iterable[int]) -> None:
        """Reserve loopback ports of the node agent's listeners to one sandbox (no other sandbox
        reaches them whatever its rules)."""
        table = self._table("private_ports")
        for port in ports:
            table[ctypes.c_uint32(port)] = ctypes.c_uint64(cgroup_id)

    def drop_cidrs(self, cgroup_id: int) -> None:
        """Remove a cgroup's address-range grants (before they are set again)."""
        for name in ("cidr4", "cidr6"):
            table = self._table(name)
            for k in [k for k in table if int(k.cgid) == cgroup_id]:
                table.pop(k, None)

    def clear_private_ports(self) -> None:
        """Forget every reservation (the listeners of an earlier agent are gone with it)."""
        self._table("private_ports").clear()

    def purge(self, cgroup_id: int) -> None:
        """Remove every entry of a cgroup from every map."""
        private = self._table("private_ports")
        for k in [k for k, v in private.items() if int(v.value) == cgroup_id]:
            private.pop(k, None)
        sandboxes = self._table("sandboxes")
        key = ctypes.c_uint64(cgroup_id)
        leaf = sandboxes.get(key)
        if leaf is not None:
            port = _htons(int(leaf.proxy_port))  # (a swap: its own inverse)
            del sandboxes[key]
            if not any(_htons(int(v.proxy_port)) == port for v in sandboxes.values()):
                self._table("dns_ports").pop(ctypes.c_uint32(port), None)
        for name in _PER_CGROUP_MAPS:
            table = self._table(name)
            for k in [k for k in table if int(k.cgid) == cgroup_id]:
                table.pop(k, None)
        # after the sandbox's entry (a socket made meanwhile would count again). Its sockets
        # still alive stay in the node's count (they hold the host's ports) until released.
        self._table("sock_use").pop(key, None)

    def sweep(self, now_ns: int) -> int:
        """Delete expired DNS grants (the hooks already ignore them); return how many."""
        removed = 0
        for name in ("host4", "host6"):
            table = self._table(name)
            stale = [k for k, v in table.items() if v.expires_ns and v.expires_ns < now_ns]
            for k in stale:
                table.pop(k, None)
            removed += len(stale)
        return removed

    def counters(self) -> dict[tuple[int, int, int], int]:
        """(cgroup id, rule slot, verdict) -> count, summed over CPUs."""
        out: dict[tuple[int, int, int], int] = {}
        for k, per_cpu in self._table("counters").items():
            out[(int(k.cgid), int(k.rule), int(k.verdict))] = sum(int(v) for v in per_cpu)
        return out

    def host_entries(self, cgroup_id: int) -> Iterator[tuple[IPAddress, int, int, int]]:
        """(address, port, slot, expires_ns) of the DNS grants of a cgroup."""
        for name, version in (("host4", 4), ("host6", 6)):
            for k, v in self._table(name).items():
                if int(k.cgid) != cgroup_id:
                    continue
                raw = _words_bytes([k.addr]) if version == 4 else _words_bytes(k.addr)
                yield ipaddress.ip_address(raw), int(k.port), int(v.rule), int(v.expires_ns)

    # --- events ----------------------------------------------------------------------------

    def open_events(self, callback: Callable[[RawEvent], None]) -> int:
        """Start reading the ring buffer; return an fd that is readable when events wait."""
        table = self._table("events")

        def on_event(_ctx: Any, data: Any, _size: int) -> int:
            callback(self._decode(table.event(data)))
            self._budget -= 1
            return 0 if self._budget > 0 else -1  # negative: libbpf stops consuming here

        table.open_ring_buffer(on_event)
        return libbpf.ring_buffer_epoll_fd(self._bpf._ringbuf_manager)

    def consume_events(self, limit: int = 1 << 30) -> int:
        """Deliver waiting events to the callback (non-blocking), at most ``limit`` of them;
        return how many were delivered (the rest stay in the ring buffer)."""
        if self._bpf is None:
            return 0
        self._budget = limit
        self._bpf.ring_buffer_consume()
        return limit - self._budget

    @staticmethod
    def _decode(ev: Any) -> RawEvent:
        raw = _words_bytes(ev.addr)
        address: IPAddress = (
            ipaddress.IPv4Address(raw[:4]) if ev.family == 4 else ipaddress.IPv6Address(raw)
        )
        return RawEvent(
            ts_ns=int(ev.ts_ns),
            cgroup_id=int(ev.cgid),
            pid=int(ev.pid),
            rule=int(ev.rule),
            verdict=int(ev.verdict),
            hook=int(ev.hook),
            family=int(ev.family),
            proto=int(ev.proto),
            port=int(ev.port),
            address=address,
            comm=bytes(ev.comm).split(b"\0", 1)[0].decode(errors="replace"),
        )
