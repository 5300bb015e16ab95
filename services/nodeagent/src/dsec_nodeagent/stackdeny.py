"""The stack's own servers as a kernel deny set: ``(address, port)`` no sandbox may reach.

The endpoints come from the settings and ``stack.json`` (:func:`dsec_core.stackinfo.
stack_endpoints`). A server on the node itself (loopback, ``0.0.0.0``, ``localhost``) is denied on
every local address of the node, since a server bound to ``0.0.0.0`` answers on all of them; the
BPF side also maps any ``127.x.y.z``/``0.0.0.0`` destination to ``127.0.0.1`` (and ``::``/``::1``
to ``::1``) before its lookup.
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

from dsec_core.stackinfo import Endpoint, is_local

Resolver = Callable[[str], list[str]]


def local_addresses(proc: Path = Path("/proc/net")) -> set[str]:
    """The node's own addresses: LOCAL entries of ``fib_trie`` and ``if_inet6``."""
    found = {"127.0.0.1", "::1"}
    try:
        lines = (proc / "fib_trie").read_text().splitlines()
    except OSError:
        lines = []
    for previous, line in itertools.pairwise(lines):
        if line.strip().endswith("host LOCAL") and "|--" in previous:
            found.add(previous.split("|--")[1].strip())
    try:
        rows = (proc / "if_inet6").read_text().splitlines()
    except OSError:
        rows = []
    for row in rows:
        hexaddr = row.split()[0] if row.split() else ""
        if len(hexaddr) == 32:
            found.add(str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))))
    return found


def resolve(host: str) -> list[str]:
    """Addresses of a host name (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


def deny_entries(
    endpoints: Iterable[Endpoint], local: Iterable[str], resolver: Resolver = resolve
) -> set[tuple[str, int]]:
    """Every ``(address, port)`` at which a sandbox could reach one of ``endpoints`` (pure but for
    ``resolver``)."""
    own = sorted(set(local))
    out: set[tuple[str, int]] = set()
    for _, host, port in endpoints:
        if is_local(host):
            addresses = own
        else:
            try:
                addresses = [str(ipaddress.ip_address(host))]
            except ValueError:
                addresses = resolver(host)
            if any(is_local(a) for a in addresses):
                addresses = [*addresses, *own]
        out |= {(str(ipaddress.ip_address(a)), port) for a in addresses}
    return out
