"""pytest fixtures that start DSec's real servers (NATS JetStream, PostgreSQL, SeaweedFS S3,
OpenBao) on free ports, with the same code as ``dsec up``. Registered as the ``dsec`` pytest
plugin; see :mod:`dsec_testing.plugin` for the fixtures.

The names below load on first use, so registering the plugin costs every pytest run nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec_testing.stack import NatsRestarter, S3Info, ServiceRunner, StackFixture, VaultInfo

__all__ = ["NatsRestarter", "S3Info", "ServiceRunner", "StackFixture", "VaultInfo"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dsec_testing import stack

        return getattr(stack, name)
    raise AttributeError(f"module 'dsec_testing' has no attribute {name!r}")
