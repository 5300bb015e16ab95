"""Credentials of the embedded NATS: nkey seeds per identity (0600 under ``$DSEC_HOME/nats``),
the operator's bcrypt'd password, and the server's ``authorization`` config rendered from
:mod:`dsec_core.natsperms`."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import bcrypt
import nkeys
from dsec_core import natsperms
from dsec_core.natsclient import DEFAULT_USER_IDENTITY, credential_path

from dsec_cli.stack.adapters.servers import write_private

LOCAL_IDENTITIES: tuple[str, ...] = (
    *natsperms.SERVICES,
    DEFAULT_USER_IDENTITY,
    natsperms.FLEETSIM,
)
"""Identities ``dsec up`` creates nkeys for: each service, the local tenant's user and the
simulated fleet (``dsec fleet simulate``)."""

BCRYPT_ROUNDS = 8
"""The operator password is 32 random bytes (192 bits), so the cost factor is not what protects
it; a low cost keeps each operator connection (tests make many) cheap for the server."""


def new_seed() -> str:
    """A fresh user nkey seed (``SU...``)."""
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)).decode()


def public_key(seed: str) -> str:
    """The public nkey (``U...``) of ``seed``."""
    return bytes(nkeys.from_seed(bytearray(seed.strip().encode())).public_key).decode()


_SEEDS = threading.Lock()
"""The members of a NATS cluster render their configs in parallel: one seed per identity."""


def ensure_identity(home: Path, identity: str) -> str:
    """Create ``identity``'s seed file (0600) unless it exists; return its public key."""
    path = credential_path(home, identity)
    with _SEEDS:
        return _ensure_seed(path)


def _ensure_seed(path: Path) -> str:
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        write_private(path, new_seed() + "\n")
    return public_key(path.read_text())


def hash_password(password: str) -> str:
    """bcrypt hash in the ``$2a$`` form nats-server accepts."""
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS, prefix=b"2a"))
    return hashed.decode()


def node_identity(node: str) -> str:
    """The NATS identity of the node agent of an extra node (``nodeagent-node-2``): it may use
    only its own node's durables (:mod:`dsec_core.natsperms`)."""
    return f"nodeagent-{node}"


def render_config(home: Path, operator_password: str, nodes: Sequence[str] = ()) -> str:
    """The server's authorization config: the operator (password), each local identity and the
    node agent of each extra node of this machine (``nodes``)."""
    identities = [
        natsperms.Identity(
            natsperms.OPERATOR,
            user=natsperms.OPERATOR,
            password_hash=hash_password(operator_password),
        )
    ]
    names = [*LOCAL_IDENTITIES, *(node_identity(n) for n in nodes)]
    identities += [natsperms.Identity(name, nkey=ensure_identity(home, name)) for name in names]
    return natsperms.render_authorization(identities)


CLUSTER_NAME = "dsec"
ROUTE_USER = "route"


def render_cluster(listen_port: int, route_ports: list[int], route_password: str) -> str:
    """The ``cluster`` block of one server of the embedded NATS cluster: it listens for routes on
    ``listen_port`` (loopback) and dials the others; a route must know the cluster password
    (so no local process can join as a server and bypass the clients' authorization)."""
    routes = ", ".join(
        f'"nats-route://{ROUTE_USER}:{route_password}@127.0.0.1:{p}"' for p in route_ports
    )
    return (
        "cluster {\n"
        f"  name: {CLUSTER_NAME}\n"
        f"  listen: 127.0.0.1:{listen_port}\n"
        f'  authorization {{ user: {ROUTE_USER}, password: "{hash_password(route_password)}" }}\n'
        f"  routes: [{routes}]\n"
        "}\n"
    )


def operator_url(url: str, password: str) -> str:
    """``url`` with the operator's ``user:password@``."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{natsperms.OPERATOR}:{password}@{rest}"


def create_stream(
    url: str,
    *,
    options: Mapping[str, Any] | None = None,
    timeout: float = 10.0,
    replicas: int | None = None,
) -> None:
    """As the operator (credentials in ``url`` or ``options``), create ``DSEC_EVENTS`` or
    restore its guarantees (:func:`dsec_core.bus.ensure_stream`; ``replicas`` on a cluster)."""
    import nats
    from dsec_core.bus import ensure_stream

    async def run() -> None:
        nc = await nats.connect(
            url, connect_timeout=timeout, max_reconnect_attempts=0, **dict(options or {})
        )
        try:
            await ensure_stream(nc.jetstream(timeout=timeout), replicas=replicas)
        finally:
            await nc.close()

    asyncio.run(run())


def deploy_identities(tenants: list[str]) -> list[str]:
    """Every service, the simulated fleet and one ``user-<tenant>`` per tenant."""
    return [*natsperms.SERVICES, natsperms.FLEETSIM, *(f"{natsperms.USER}-{t}" for t in tenants)]


def write_deploy_credentials(out: Path, tenants: list[str]) -> dict[str, str]:
    """Credentials for ``deploy/nats/nats-server.conf`` under ``out`` (0700): one nkey seed per
    identity (``<id>.nk``), the operator password (``operator.password``, and as
    ``operator.env`` for ``dsec nats stream``), and ``nats-server.env`` with what the server
    needs (bcrypt hash, public keys), and ``nats-server.conf`` for exactly these tenants (the
    repository's ``deploy/nats/nats-server.conf`` has the tenant ``default``). Existing seeds,
    tenants and the password are kept, so running it again only adds identities.

    Returns:
        identity -> public key.
    """
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    prefix = f"{natsperms.USER}-"
    known = [p.stem[len(prefix) :] for p in out.glob(f"{prefix}*.nk")]
    tenants = list(dict.fromkeys([*known, *tenants]))
    pw_file = out / "operator.password"
    if not pw_file.is_file():
        import secrets

        write_private(pw_file, secrets.token_urlsafe(24) + "\n")
    publics: dict[str, str] = {}
    lines = [f"DSEC_NATS_OPERATOR_BCRYPT='{hash_password(pw_file.read_text().strip())}'"]
    for identity in deploy_identities(tenants):
        seed = out / f"{identity}.nk"
        if not seed.is_file():
            write_private(seed, new_seed() + "\n")
        publics[identity] = public_key(seed.read_text())
        var = "DSEC_NKEY_" + identity.upper().replace("-", "_")
        lines.append(f"{var}={publics[identity]}")
    write_private(out / "nats-server.env", "\n".join(lines) + "\n")
    write_private(out / "nats-server.conf", natsperms.render_deploy_config(tenants))
    operator_env = (
        f"DSEC_NATS_USER={natsperms.OPERATOR}\nDSEC_NATS_PASSWORD='{pw_file.read_text().strip()}'\n"
    )
    write_private(out / "operator.env", operator_env)
    return publics
