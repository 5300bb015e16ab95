"""The DSec sandbox spec: schema, located errors, loading, migration and plan compilation.

Typical use::

    result = load_spec(text, "dsec.yaml")
    if result.ok:
        plan = compile_plan(result.spec)
    else:
        for error in result.errors:
            print(error.format())

The names below are imported on first use (PEP 562): ``dsec_core.events`` needs only the plan's
models at import, not the YAML loader, migrations and located errors (commands such as ``dsec
audit verify`` start that much sooner).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec_core.spec.errors import Severity, SpecError, format_path
    from dsec_core.spec.loader import DocumentResult, SpecResult, load_document, load_spec
    from dsec_core.spec.migrate import SUPPORTED_VERSIONS
    from dsec_core.spec.models import (
        CURRENT_VERSION,
        DEFAULT_VAULT_KEY,
        ComputeUnit,
        Dependency,
        EgressRule,
        EnvVar,
        Filesystem,
        Gpu,
        GpuNeeds,
        IncludeCode,
        Link,
        Migration,
        Mount,
        MountSource,
        Network,
        Resources,
        RuntimeContext,
        SandboxSpec,
        Scheduling,
        SecurityPolicy,
        SemanticMatch,
        SemanticRule,
        State,
        StateRetention,
        Task,
        VaultRef,
        normalize_domain,
        parse_mount_source,
        parse_vault_ref,
    )
    from dsec_core.spec.plan import (
        EdgePlan,
        EnforcementPlan,
        FilesystemPlan,
        GpuLimits,
        MigrationPlan,
        MountPlan,
        PackageRequirement,
        PlainEnv,
        PlanEgressRule,
        ResourceLimits,
        SecretInjection,
        SemanticPlanRule,
        StatePlan,
        TopologyPlan,
        UnitPlan,
        compile_plan,
    )
    from dsec_core.spec.source import FieldPath, Position, SourceMap
    from dsec_core.spec.units import (
        ByteSize,
        Cores,
        Duration,
        Rate,
        format_duration,
        format_size,
        parse_cpu,
        parse_duration,
        parse_rate,
        parse_size,
    )

_WHERE = {
    "Severity": "errors",
    "SpecError": "errors",
    "format_path": "errors",
    "DocumentResult": "loader",
    "SpecResult": "loader",
    "load_document": "loader",
    "load_spec": "loader",
    "SUPPORTED_VERSIONS": "migrate",
    "CURRENT_VERSION": "models",
    "DEFAULT_VAULT_KEY": "models",
    "ComputeUnit": "models",
    "Dependency": "models",
    "EgressRule": "models",
    "EnvVar": "models",
    "Filesystem": "models",
    "Gpu": "models",
    "GpuNeeds": "models",
    "IncludeCode": "models",
    "Link": "models",
    "Migration": "models",
    "Mount": "models",
    "MountSource": "models",
    "Network": "models",
    "Resources": "models",
    "RuntimeContext": "models",
    "SandboxSpec": "models",
    "Scheduling": "models",
    "SecurityPolicy": "models",
    "SemanticMatch": "models",
    "SemanticRule": "models",
    "State": "models",
    "StateRetention": "models",
    "Task": "models",
    "VaultRef": "models",
    "normalize_domain": "models",
    "parse_mount_source": "models",
    "parse_vault_ref": "models",
    "EdgePlan": "plan",
    "EnforcementPlan": "plan",
    "FilesystemPlan": "plan",
    "GpuLimits": "plan",
    "MigrationPlan": "plan",
    "MountPlan": "plan",
    "PackageRequirement": "plan",
    "PlainEnv": "plan",
    "PlanEgressRule": "plan",
    "ResourceLimits": "plan",
    "SecretInjection": "plan",
    "SemanticPlanRule": "plan",
    "StatePlan": "plan",
    "TopologyPlan": "plan",
    "UnitPlan": "plan",
    "compile_plan": "plan",
    "FieldPath": "source",
    "Position": "source",
    "SourceMap": "source",
    "ByteSize": "units",
    "Cores": "units",
    "Duration": "units",
    "Rate": "units",
    "format_duration": "units",
    "format_size": "units",
    "parse_cpu": "units",
    "parse_duration": "units",
    "parse_rate": "units",
    "parse_size": "units",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # (the next read is a plain one)
    return value


__all__ = [
    "CURRENT_VERSION",
    "DEFAULT_VAULT_KEY",
    "SUPPORTED_VERSIONS",
    "ByteSize",
    "ComputeUnit",
    "Cores",
    "Dependency",
    "DocumentResult",
    "Duration",
    "EdgePlan",
    "EgressRule",
    "EnforcementPlan",
    "EnvVar",
    "FieldPath",
    "Filesystem",
    "FilesystemPlan",
    "Gpu",
    "GpuLimits",
    "GpuNeeds",
    "IncludeCode",
    "Link",
    "Migration",
    "MigrationPlan",
    "Mount",
    "MountPlan",
    "MountSource",
    "Network",
    "PackageRequirement",
    "PlainEnv",
    "PlanEgressRule",
    "Position",
    "Rate",
    "ResourceLimits",
    "Resources",
    "RuntimeContext",
    "SandboxSpec",
    "Scheduling",
    "SecretInjection",
    "SecurityPolicy",
    "SemanticMatch",
    "SemanticPlanRule",
    "SemanticRule",
    "Severity",
    "SourceMap",
    "SpecError",
    "SpecResult",
    "State",
    "StatePlan",
    "StateRetention",
    "Task",
    "TopologyPlan",
    "UnitPlan",
    "VaultRef",
    "compile_plan",
    "format_duration",
    "format_path",
    "format_size",
    "load_document",
    "load_spec",
    "normalize_domain",
    "parse_cpu",
    "parse_duration",
    "parse_mount_source",
    "parse_rate",
    "parse_size",
    "parse_vault_ref",
]
