"""The ``.test`` zone the node agent's DNS tests resolve against, served by
:class:`dsec_testing.dns_zone.ZoneServer` (a real authoritative server on loopback)."""

from __future__ import annotations

from dsec_testing.dns_zone import ZoneServer

__all__ = ["TEST_ZONE", "ZoneServer", "big_zone_records", "start_test_dns"]

TEST_ZONE = """\
$ORIGIN test.
$TTL 300
@               SOA   ns.test. hostmaster.test. 1 3600 600 86400 60
@               NS    ns.test.
ns              A     127.0.0.1
allowed         A     127.0.0.10
allowed         AAAA  ::1
denied          A     127.0.0.20
other           A     127.0.0.21
www.wild        A     127.0.0.12
deep.a.wild     A     127.0.0.12
wild            A     127.0.0.14
alias           CNAME edge.cdn.test.
edge.cdn        A     127.0.0.15
loop1           CNAME loop2.test.
loop2           CNAME loop1.test.
mixed           A     127.0.0.13
mixed           A     203.0.113.5
short     2     A     127.0.0.11
txt             TXT   "hello"
rebind          A     127.0.0.1
rebind          AAAA  ::1
meta            A     169.254.169.254
meta            AAAA  fe80::1
long    86400   A     127.0.0.16
node            A     192.0.2.50
"""


def big_zone_records(count: int = 100) -> str:
    """``big.test`` with ``count`` A records: too large for UDP (512 bytes and EDNS 1232)."""
    records = "".join(f"big A 127.0.1.{i}\n" for i in range(1, count + 1))
    for n in (2, 3):  # big2.test, big3.test: 40 more addresses each (the quota tests)
        records += "".join(f"big{n} A 127.0.{n}.{i}\n" for i in range(1, 41))
    return records


async def start_test_dns(host: str = "127.0.0.1") -> ZoneServer:
    """The ``.test`` zone (plus ``big.test``) on ``host`` at a free port."""
    return await ZoneServer([TEST_ZONE + big_zone_records()], host=host).start()
