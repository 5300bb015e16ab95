"""The stack's own endpoints and directories, which no sandbox may reach.

Read from the settings and ``$DSEC_HOME/stack.json`` (what ``dsec up`` recorded): NATS,
PostgreSQL, S3, OpenBao, Prometheus, every server's ports and every service's metrics port. The
policy service refuses specs that name them; the node agent puts them in a deny set that wins over
any allow rule.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from dsec_core.settings import Settings

Endpoint = tuple[str, str, int]
"""``(what, host, port)``."""

_LOCAL = "127.0.0.1"
_URLS = {
    "nats_url": ("NATS", 4222),
    "postgres_dsn": ("PostgreSQL", 5432),
    "s3_endpoint": ("S3", 80),
    "vault_addr": ("OpenBao", 8200),
    "prometheus_url": ("Prometheus", 9090),
}


def parse_endpoint(value: str, default_port: int) -> list[tuple[str, int]]:
    """``(host, port)`` of a URL, DSN or ``host:port`` (a comma-separated list gives several)."""
    out = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        parsed = urlsplit(part if "://" in part else f"tcp://{part}")
        try:
            port = parsed.port or default_port
        except ValueError:
            continue
        if parsed.hostname:
            out.append((parsed.hostname.lower(), port))
    return out


def stack_endpoints(settings: Settings) -> tuple[Endpoint, ...]:
    """Every endpoint of the stack the settings and ``stack.json`` name (deduplicated)."""
    state: dict[str, Any] = settings.stack_state
    found: list[Endpoint] = []
    for field, (what, port) in _URLS.items():
        value = getattr(settings, field, None) or state.get(field)
        if isinstance(value, str):
            found += [(what, h, p) for h, p in parse_endpoint(value, port)]
    for name, server in (state.get("servers") or {}).items():
        if not isinstance(server, dict) or server.get("absent"):
            continue
        hosts = {h for h, _ in parse_endpoint(str(server.get("endpoint") or ""), 0)} or {_LOCAL}
        # every port it listens on (before, SeaweedFS's gRPC ports at +10000 and OpenBao's
        # cluster port were left out: a sandbox could be granted them)
        ports = {int(p) for p in [*(server.get("ports") or []), *(server.get("listening") or [])]}
        found += [(name, h, p) for h in sorted(hosts) for p in sorted(ports)]
    for name, service in (state.get("services") or {}).items():
        metrics = service.get("metrics_port") if isinstance(service, dict) else None
        if isinstance(metrics, int) and metrics > 0:
            found.append((f"{name} metrics", _LOCAL, metrics))
    if settings.metrics_port > 0:
        found.append(("metrics", _LOCAL, settings.metrics_port))
    seen: set[tuple[str, int]] = set()
    out: list[Endpoint] = []
    for what, host, port in found:
        if (host, port) not in seen and 0 < port < 65536:
            seen.add((host, port))
            out.append((what, host, port))
    return tuple(out)


def is_local(host: str) -> bool:
    """A loopback or unspecified address, or ``localhost``: the node itself."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def stack_dirs(settings: Settings) -> tuple[str, ...]:
    """Host directories holding the stack's state (``DSEC_HOME``: keys, data, logs)."""
    return (str(settings.home.resolve()),)
