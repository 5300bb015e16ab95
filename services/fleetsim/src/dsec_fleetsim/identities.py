"""One certified node-agent identity per simulated node, from the operator root.

Each node signs as ``nodeagent-<node>`` (role ``nodeagent``, bound to its node), certified by
the operator root (``$DSEC_HOME/trust/root.key``), exactly like ``dsec up --nodes`` certifies an
extra node's agent, so every consumer's trust gate accepts its events and authorizes them for
its node only. The keys are derived from one secret (``$DSEC_HOME/fleetsim/seed``, 0600): a
node keeps its key id across restarts of the simulation and thousands of keys cost no files.
Certificates are issued in memory at each start (one root signature each, ~50 µs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import blake3
from dsec_core import identity
from dsec_core.identity import Certificate
from dsec_core.signing import Signer, load_or_create_key
from nacl.signing import SigningKey

SEED_FILE = Path("fleetsim") / "seed"


class NoRoot(RuntimeError):
    """The operator root key is not readable here (only the operator simulates a fleet)."""


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """A simulated node's key and its certificate."""

    key: SigningKey
    cert: Certificate

    def signer(self) -> Signer:
        """A new signer (a new chain: a node agent process's)."""
        return Signer(self.cert.subject, self.key)


def root_key(home: Path, path: Path | None = None) -> SigningKey:
    """The operator root (``path``, default ``$DSEC_HOME/trust/root.key``).

    Raises:
        NoRoot: it is missing or unreadable.
    """
    where = path or identity.TrustPaths(home).root_key
    try:
        return SigningKey(where.read_bytes())
    except OSError as exc:
        raise NoRoot(
            f"the operator root key {where} is not readable ({exc.strerror or exc}): only the "
            "operator can certify simulated nodes (run on the machine of `dsec up`, or pass "
            "--root-key)"
        ) from None


def fleet_secret(home: Path) -> bytes:
    """The secret the nodes' keys derive from (created on first use, 0600)."""
    return bytes(load_or_create_key(home / SEED_FILE))


def node_key(secret: bytes, node_id: str) -> SigningKey:
    """The key of one node: BLAKE3 keyed by the secret, of the node id."""
    return SigningKey(blake3.blake3(node_id.encode(), key=secret).digest())


def certify(root: SigningKey, secret: bytes, node_id: str) -> NodeIdentity:
    """The node's key and a root certificate for ``nodeagent-<node>``."""
    key = node_key(secret, node_id)
    cert = identity.issue(
        root,
        bytes(key.verify_key),
        subject=f"nodeagent-{node_id}",
        role="nodeagent",
        node_id=node_id,
    )
    return NodeIdentity(key, cert)
