"""Settings for every DSec process: environment variables with the ``DSEC_`` prefix.

Each endpoint left unset means "use the embedded stack under ``DSEC_HOME``"; set it to point at
an existing server (NATS cluster, managed Postgres, S3/MinIO, Vault) and the stack will not start
that server.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """All DSec settings. See the README's settings table."""

    model_config = SettingsConfigDict(env_prefix="DSEC_", extra="ignore", frozen=True)

    home: Path = Field(default=Path(".dsec"), description="State, data and logs of the stack")
    nats_url: str | None = Field(default=None, description="NATS server URL (external)")
    nats_creds: Path | None = Field(default=None, description="NATS credentials file (JWT)")
    nats_nkey_seed: Path | None = Field(default=None, description="NATS nkey seed file")
    nats_user: str | None = Field(default=None, description="NATS user name")
    nats_password: SecretStr | None = Field(default=None, description="NATS password")
    nats_tls_ca: Path | None = Field(default=None, description="CA bundle to verify NATS")
    nats_tls_cert: Path | None = Field(default=None, description="client certificate for NATS")
    nats_tls_key: Path | None = Field(default=None, description="client key for NATS")
    postgres_dsn: str | None = Field(
        default=None, repr=False, description="PostgreSQL DSN (external)"
    )
    s3_endpoint: str | None = Field(default=None, description="S3 endpoint host:port (external)")
    s3_access_key: str | None = Field(default=None, description="S3 access key")
    s3_secret_key: str | None = Field(default=None, repr=False, description="S3 secret key")
    s3_secure: bool = Field(default=False, description="Use TLS for S3")
    s3_bucket: str = Field(default="dsec", description="Bucket for bundles, caches, snapshots")
    vault_addr: str | None = Field(default=None, description="Vault/OpenBao address (external)")
    vault_token: str | None = Field(default=None, repr=False, description="Vault/OpenBao token")
    stream_check_s: float = Field(
        default=30.0, gt=0, description="How often a service re-checks the stream's guarantees"
    )
    metrics_port: int = Field(default=0, description="Port for /metrics and /healthz (0 = free)")
    node_id: str = Field(default="node-1", description="Name of this node")
    org_policy: Path | None = Field(default=None, description="Org guardrail policy file")
    dns_upstream: str | None = Field(default=None, description="Upstream DNS host:port")
    log_level: str = Field(default="INFO", description="Log level of services")
    snapshot_interval_s: float = Field(
        default=0.0, ge=0, description="Periodic snapshot of each running sandbox (0 = off)"
    )
    snapshot_keep: int = Field(
        default=10, ge=1, description="Periodic snapshots kept per sandbox (older are deleted)"
    )

    def endpoint(self, name: str) -> Any:
        """Return setting ``name`` if set, else the value ``dsec up`` recorded in stack.json."""
        value = getattr(self, name)
        return value if value is not None else self.stack_state.get(name)

    def nats_endpoint(self) -> str:
        """The NATS URL to use (setting, stack.json, or the conventional local default)."""
        return str(self.endpoint("nats_url") or "nats://127.0.0.1:4222")

    @cached_property
    def stack_state(self) -> dict[str, Any]:
        """Endpoints written by ``dsec up`` (``$DSEC_HOME/stack.json``), or ``{}``."""
        path = self.home / "stack.json"
        if not path.exists():
            return {}
        data: dict[str, Any] = json.loads(path.read_text())
        return data
