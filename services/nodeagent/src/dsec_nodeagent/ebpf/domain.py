"""Pure decisions of egress enforcement (no I/O): what the kernel maps must hold for a plan.

The kernel side (egress.bpf.c) only looks things up; everything that needs judgement — which
ranges count as internal, how a ``cidr`` rule becomes trie entries, which addresses a DNS answer
may open — is decided here and tested without a kernel.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from dsec_core.spec.models import LINK_LOCAL
from dsec_core.spec.models import canonical_network as canonical_network

from dsec_nodeagent.ebpf.model import EgressPlan, EgressRule, IPAddress, IPNetwork

# `allow_internal_only` keeps a rule inside loopback and private ranges. Link-local
# (169.254.0.0/16, fe80::/10) is deliberately absent: it holds cloud metadata endpoints.
INTERNAL_NETWORKS: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("10.0.0.0/8"),
    ipaddress.ip_network("172.16.0.0/12"),
    ipaddress.ip_network("192.168.0.0/16"),
    ipaddress.ip_network("::1/128"),
    ipaddress.ip_network("fc00::/7"),
)

# Public DNS-over-HTTPS / DNS-over-TLS resolvers. A sandbox reaches them only through a rule that
# names them exactly (an exact domain rule, or a host-length cidr), never through a wildcard or a
# wide range: otherwise DNS policy could be bypassed by resolving over HTTPS.
DOH_HOSTNAMES: frozenset[str] = frozenset(
    {
        "dns.google",
        "dns.google.com",
        "8888.google",
        "cloudflare-dns.com",
        "mozilla.cloudflare-dns.com",
        "chrome.cloudflare-dns.com",
        "one.one.one.one",
        "1dot1dot1dot1.cloudflare-dns.com",
        "security.cloudflare-dns.com",
        "family.cloudflare-dns.com",
        "dns.quad9.net",
        "dns9.quad9.net",
        "dns10.quad9.net",
        "dns11.quad9.net",
        "doh.opendns.com",
        "dns.opendns.com",
        "doh.familyshield.opendns.com",
        "dns.adguard.com",
        "dns.adguard-dns.com",
        "unfiltered.adguard-dns.com",
        "family.adguard-dns.com",
        "doh.cleanbrowsing.org",
        "dns.nextdns.io",
        "doh.mullvad.net",
        "dns.mullvad.net",
        "doh.dns.sb",
        "dns.alidns.com",
        "doh.pub",
        "dns.pub",
        "dns.twnic.tw",
        "ordns.he.net",
        "dns.controld.com",
        "freedns.controld.com",
        "doh.libredns.gr",
        "dns.switch.ch",
        "doh.ffmuc.net",
        "dns0.eu",
        "dns.brahma.world",
    }
)
DOH_ADDRESSES: frozenset[IPAddress] = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "8.8.8.8",
        "8.8.4.4",
        "1.1.1.1",
        "1.0.0.1",
        "1.1.1.2",
        "1.0.0.2",
        "1.1.1.3",
        "1.0.0.3",
        "9.9.9.9",
        "149.112.112.112",
        "9.9.9.10",
        "149.112.112.10",
        "9.9.9.11",
        "149.112.112.11",
        "208.67.222.222",
        "208.67.220.220",
        "94.140.14.14",
        "94.140.15.15",
        "185.228.168.9",
        "185.228.169.9",
        "194.242.2.2",
        "223.5.5.5",
        "223.6.6.6",
        "185.222.222.222",
        "45.11.45.11",
        "193.110.81.0",
        "185.253.5.0",
        "2001:4860:4860::8888",
        "2001:4860:4860::8844",
        "2606:4700:4700::1111",
        "2606:4700:4700::1001",
        "2620:fe::fe",
        "2620:fe::9",
        "2620:119:35::35",
        "2620:119:53::53",
        "2a10:50c0::ad1:ff",
        "2a10:50c0::ad2:ff",
        "2a07:e340::2",
    )
)


def parse_networks(text: str, setting: str) -> tuple[IPNetwork, ...]:
    """``"127.0.0.53, 10.0.0.0/8"`` as networks.

    Raises:
        ValueError: naming ``setting``, the bad item and the valid shape.
    """
    networks: list[IPNetwork] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(canonical_network(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise ValueError(
                f"{setting}: {item!r} is not an address or network (expected e.g. "
                "127.0.0.53,10.1.0.0/16,fd00::/8)"
            ) from None
    return tuple(networks)


def unmap(address: IPAddress) -> IPAddress:
    """``::ffff:a.b.c.d`` → ``a.b.c.d``; other addresses unchanged (the wire carries IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_internal(address: IPAddress) -> bool:
    """True for loopback and private addresses (IPv4-mapped IPv6 judged as IPv4)."""
    address = unmap(address)
    return any(address in net for net in INTERNAL_NETWORKS if net.version == address.version)


def internal_parts(network: IPNetwork) -> list[IPNetwork]:
    """The pieces of ``network`` that lie in internal ranges (for ``allow_internal_only``)."""
    parts: list[IPNetwork] = []
    for internal in INTERNAL_NETWORKS:
        if internal.version != network.version:
            continue
        if network.subnet_of(internal):  # type: ignore[arg-type]
            return [network]
        if internal.subnet_of(network):  # type: ignore[arg-type]
            parts.append(internal)
    return parts


AF_TCP = 2  # allow-entry flags (egress.bpf.c): the entry opens TCP sockets
AF_UDP = 4  # ... UDP sockets: only when the rule declares udp


def transport_flags(rule: EgressRule) -> int:
    """The ``AF_TCP``/``AF_UDP`` bits of a rule's entries (a TCP grant never opens UDP)."""
    return (AF_TCP if "tcp" in rule.protocols else 0) | (AF_UDP if "udp" in rule.protocols else 0)


@dataclass(frozen=True, slots=True)
class CidrEntry:
    """One LPM-trie entry: ``network`` on ``port`` (0 = every port) for rule ``slot``."""

    network: IPNetwork
    port: int
    slot: int
    transports: int = AF_TCP

    @property
    def host_exact(self) -> bool:
        """True when the entry names one address (such entries may name a DoH resolver)."""
        return self.network.prefixlen == self.network.max_prefixlen


def rule_ports(rule: EgressRule) -> tuple[int, ...]:
    """Ports as kernel keys: the rule's ports, or (0,) for "every port"."""
    return tuple(sorted(set(rule.ports))) or (0,)


_EVERYWHERE: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("0.0.0.0/0"),
    ipaddress.ip_network("::/0"),
)


METADATA_V6 = ipaddress.ip_network("fd00:ec2::254/128")
"""AWS's IPv6 instance metadata service (inside fc00::/7, not link-local)."""


def _carve(networks: list[IPNetwork], hole: IPNetwork) -> list[IPNetwork]:
    out: list[IPNetwork] = []
    for network in networks:
        if network.version != hole.version or not network.overlaps(hole):
            out.append(network)
        elif not network.subnet_of(hole):  # type: ignore[arg-type]
            out += sorted(network.address_exclude(hole))  # type: ignore[arg-type]
    return out


def never_opened(network: IPNetwork, *, internal: bool = False) -> list[IPNetwork]:
    """``network`` less what no rule opens (the pieces around it): the link-local ranges and
    AWS's IPv6 metadata address (a cloud machine's metadata service and its credentials), and,
    for a rule wider than them that does not say ``allow_internal_only`` (``internal``), the
    loopback ranges (the node itself; the DNS path refuses loopback answers to such a rule too).
    A rule naming loopback itself opens it. A rule inside link-local is refused by the spec."""
    parts = [network]
    for hole in (*LINK_LOCAL, METADATA_V6):
        parts = _carve(parts, hole)
    if not internal:
        for loopback, unspecified in zip(LOOPBACK_NETWORKS, UNSPECIFIED, strict=True):
            wider = network.version == loopback.version and network != loopback
            if wider and loopback.subnet_of(network):  # type: ignore[arg-type]
                parts = _carve(parts, loopback)
            # a connect to 0.0.0.0 or :: reaches the node itself over loopback
            if network.version == unspecified.version and network.overlaps(unspecified):
                parts = _carve(parts, unspecified)
    return parts


def cidr_entries(plan: EgressPlan) -> Iterator[CidrEntry]:
    """Trie entries of ``cidr`` and ``*`` rules, narrowed by ``allow_internal_only``; never
    what :func:`never_opened` leaves out."""
    for slot, rule in enumerate(plan.rules, start=1):
        if rule.cidr is not None:
            wanted = [canonical_network(rule.cidr)]
        elif rule.is_any:
            wanted = list(_EVERYWHERE)
        else:
            continue
        internal = rule.allow_internal_only
        networks = [part for net in wanted for part in never_opened(net, internal=internal)]
        if rule.allow_internal_only:
            networks = [part for net in networks for part in internal_parts(net)]
        for net in networks:
            for port in rule_ports(rule):
                yield CidrEntry(network=net, port=port, slot=slot, transports=transport_flags(rule))


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """GCRA parameters of one rule's connection bucket (see egress.bpf.c ``rate_ok``)."""

    slot: int
    interval_ns: int
    tau_ns: int


def bucket_specs(plan: EgressPlan) -> Iterator[BucketSpec]:
    """One bucket per rate-limited rule; ``tau`` lets ``bucket_size`` connects through at once."""
    for slot, rule in enumerate(plan.rules, start=1):
        limit = rule.rate_limit
        if limit is None:
            continue
        interval = limit.interval_ns
        yield BucketSpec(slot=slot, interval_ns=interval, tau_ns=(limit.bucket_size - 1) * interval)


# DNS answers that point here are refused (dropped from the answer, reported) whatever the rule:
# metadata endpoints and other link-local hosts, "this network", multicast and broadcast.
NEVER_FROM_DNS: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("169.254.0.0/16"),
    ipaddress.ip_network("fe80::/10"),
    ipaddress.ip_network("0.0.0.0/8"),
    ipaddress.ip_network("::/128"),
    ipaddress.ip_network("224.0.0.0/4"),
    ipaddress.ip_network("ff00::/8"),
    ipaddress.ip_network("255.255.255.255/32"),
)
# Refused unless the rule allows internal targets (``allow_internal_only``): the node itself.
LOOPBACK_NETWORKS: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
UNSPECIFIED: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("0.0.0.0/8"),
    ipaddress.ip_network("::/128"),
)
"""Addresses a connect turns into the node itself (paired with :data:`LOOPBACK_NETWORKS`)."""


@functools.lru_cache(maxsize=4096)
def _answer_kind(address: IPAddress) -> str:
    """``never`` (link-local, unspecified, multicast, broadcast), ``loopback`` or ``other``.

    Cached: answers repeat the same few addresses, and ``ipaddress`` membership tests are slow.
    """
    if any(address in net for net in NEVER_FROM_DNS if net.version == address.version):
        return "never"
    if any(address in net for net in LOOPBACK_NETWORKS if net.version == address.version):
        return "loopback"
    return "other"


def answer_refusal(
    rule: EgressRule,
    address: IPAddress,
    protected: frozenset[IPAddress] = frozenset(),
    trusted: tuple[IPNetwork, ...] = (),
) -> str | None:
    """Why a DNS answer address must not be opened under ``rule`` (DNS rebinding), or None.

    ``protected`` holds the node's own addresses and the stack's servers' addresses: refused,
    like loopback, unless the rule explicitly allows internal targets (``allow_internal_only``)
    or the operator trusts the address (``trusted``, e.g. a local test world's API).
    Link-local (cloud metadata), unspecified, multicast and broadcast are refused always.
    """
    plain = unmap(address)
    kind = _answer_kind(plain)
    if kind == "never":
        return f"{plain} is link-local, unspecified, multicast or broadcast"
    if rule.allow_internal_only or (trusted and any(plain in net for net in trusted)):
        return None
    if kind == "loopback":
        return f"{plain} is loopback (the rule does not set allow_internal_only)"
    if plain in protected:
        return (
            f"{plain} is this node's or the stack's own address (the rule does not set "
            "allow_internal_only)"
        )
    return None


def screen_answer(
    rule: EgressRule,
    address: IPAddress,
    exact_name: bool,
    protected: frozenset[IPAddress] = frozenset(),
    trusted: tuple[IPNetwork, ...] = (),
) -> tuple[bool, str | None]:
    """Whether ``rule`` may open an answered address, and the rebinding refusal if there is one.

    ``allow_internal_only`` drops public addresses; well-known DoH resolvers are dropped unless
    the name was matched by an exact (non-wildcard) rule; an `answer_refusal` drops it too.
    """
    plain = unmap(address)
    refusal = answer_refusal(rule, plain, protected, trusted)
    if refusal is not None:
        return False, refusal
    if rule.allow_internal_only and not is_internal(plain):
        return False, None
    if plain in DOH_ADDRESSES and not exact_name:
        return False, None
    return True, None


def grantable(
    rule: EgressRule,
    addresses: Iterable[IPAddress],
    exact_name: bool,
    protected: frozenset[IPAddress] = frozenset(),
    trusted: tuple[IPNetwork, ...] = (),
) -> list[IPAddress]:
    """The answered addresses a domain rule may open (see `screen_answer`)."""
    return [
        unmap(a) for a in addresses if screen_answer(rule, a, exact_name, protected, trusted)[0]
    ]
