"""The embedded stack: real servers (NATS JetStream, PostgreSQL, SeaweedFS S3, OpenBao,
Prometheus) and the DSec services, started by ``dsec up`` and by the ``dsec_testing`` fixtures
with the same code."""

from dsec_cli.stack.adapters.probes import ProbeError
from dsec_cli.stack.adapters.servers import (
    SERVER_CLASSES,
    NatsServer,
    PostgresServer,
    PrometheusServer,
    S3Server,
    Server,
    VaultServer,
)
from dsec_cli.stack.adapters.services import ServiceProcess, ServiceSpec
from dsec_cli.stack.domain import (
    CORE_SERVERS,
    DEFAULT_SERVICES,
    SERVER_NAMES,
    ExternalEndpoints,
    StackState,
    State,
)
from dsec_cli.stack.errors import (
    BinaryMissingError,
    PortInUseError,
    ServerStartError,
    ServiceFailed,
    StackConfigError,
    StackError,
    StackStateError,
    StartFailed,
    StopError,
)
from dsec_cli.stack.stack import (
    ComponentStatus,
    DownResult,
    NeverStarted,
    Stack,
    StackStatus,
    UpResult,
)

__all__ = [
    "CORE_SERVERS",
    "DEFAULT_SERVICES",
    "SERVER_CLASSES",
    "SERVER_NAMES",
    "BinaryMissingError",
    "ComponentStatus",
    "DownResult",
    "ExternalEndpoints",
    "NatsServer",
    "NeverStarted",
    "PortInUseError",
    "PostgresServer",
    "ProbeError",
    "PrometheusServer",
    "S3Server",
    "Server",
    "ServerStartError",
    "ServiceFailed",
    "ServiceProcess",
    "ServiceSpec",
    "Stack",
    "StackConfigError",
    "StackError",
    "StackState",
    "StackStateError",
    "StackStatus",
    "StartFailed",
    "State",
    "StopError",
    "UpResult",
    "VaultServer",
]
