"""Runtime context: secrets from Vault/OpenBao as leases, S3 data, config maps — injected before
a sandbox starts, released when it exits. Records carry names, hashes and lease ids only."""

from __future__ import annotations

from dsec_nodeagent.context.configmap import ConfigMaps
from dsec_nodeagent.context.injector import ContextInjector, PreparedContext
from dsec_nodeagent.context.models import ContextError, InjectionRecord
from dsec_nodeagent.context.s3 import S3Materializer
from dsec_nodeagent.context.vault import Lease, VaultSecrets

__all__ = [
    "ConfigMaps",
    "ContextError",
    "ContextInjector",
    "InjectionRecord",
    "Lease",
    "PreparedContext",
    "S3Materializer",
    "VaultSecrets",
]
