"""``configmap://NAME/KEY`` mounts from the NATS KV bucket ``dsec-configmaps``.

The KV key is ``NAME.KEY`` (dots separate NATS tokens, so ``NAME.>`` watches a whole config
map). The value becomes the file ``KEY`` in the mount's directory, read-only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import blake3
import nats
import nats.errors
import nats.js.errors

from dsec_nodeagent.context.models import ContextError

BUCKET = "dsec-configmaps"


def kv_key(name: str, key: str) -> str:
    """The NATS KV key of a config map entry."""
    return f"{name}.{key}"


class ConfigMaps:
    """Reads config map entries (one NATS connection per :meth:`read_many` call)."""

    def __init__(
        self, nats_url: str, bucket: str = BUCKET, nats_options: Mapping[str, Any] | None = None
    ) -> None:
        self.nats_url = nats_url
        self.bucket = bucket
        self.nats_options = dict(nats_options or {})  # credentials, TLS (dsec_core.natsclient)

    async def materialize(self, name: str, key: str, dest: Path) -> tuple[str, int, int]:
        """Write the entry to ``dest/KEY``; return ``(digest, bytes, revision)``.

        Raises:
            ContextError: the bucket or the key does not exist, or NATS is unreachable.
        """
        uri = f"configmap://{name}/{key}"
        try:
            nc = await nats.connect(
                self.nats_url.split(","),  # a cluster's servers, comma-separated
                connect_timeout=5,
                max_reconnect_attempts=0,
                **self.nats_options,
            )
        except (OSError, nats.errors.Error) as exc:
            raise ContextError(
                uri, f"NATS unreachable at {self.nats_url}: {exc}", transient=True
            ) from exc
        try:
            try:
                kv = await nc.jetstream().key_value(self.bucket)
                entry = await kv.get(kv_key(name, key))
            except nats.js.errors.BucketNotFoundError as exc:
                raise ContextError(uri, f"NATS KV bucket {self.bucket!r} does not exist") from exc
            except nats.js.errors.KeyNotFoundError as exc:
                raise ContextError(
                    uri, f"no key {kv_key(name, key)!r} in NATS KV bucket {self.bucket!r}"
                ) from exc
        finally:
            await nc.close()
        value = entry.value or b""
        dest.mkdir(parents=True, mode=0o755)
        target = dest / key
        target.write_bytes(value)
        os.chmod(target, 0o444)
        return blake3.blake3(value).hexdigest(), len(value), int(entry.revision or 0)
