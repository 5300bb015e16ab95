"""The DSec sandbox spec: schema, located errors, loading, migration and plan compilation.

Typical use::

    result = load_spec(text, "dsec.yaml")
    if result.ok:
        plan = compile_plan(result.spec)
    else:
        for error in result.errors:
            print(error.format())
"""

from dsec_core.spec.errors import Severity, SpecError, format_path
from dsec_core.spec.loader import DocumentResult, SpecResult, load_document, load_spec
from dsec_core.spec.migrate import SUPPORTED_VERSIONS
from dsec_core.spec.models import (
    CURRENT_VERSION,
    DEFAULT_VAULT_KEY,
    Dependency,
    EgressRule,
    EnvVar,
    Filesystem,
    Gpu,
    IncludeCode,
    Mount,
    MountSource,
    Network,
    Resources,
    RuntimeContext,
    SandboxSpec,
    SecurityPolicy,
    SemanticMatch,
    SemanticRule,
    VaultRef,
    normalize_domain,
    parse_mount_source,
    parse_vault_ref,
)
from dsec_core.spec.plan import (
    EnforcementPlan,
    FilesystemPlan,
    GpuLimits,
    MountPlan,
    PackageRequirement,
    PlainEnv,
    PlanEgressRule,
    ResourceLimits,
    SecretInjection,
    SemanticPlanRule,
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

__all__ = [
    "CURRENT_VERSION",
    "DEFAULT_VAULT_KEY",
    "SUPPORTED_VERSIONS",
    "ByteSize",
    "Cores",
    "Dependency",
    "DocumentResult",
    "Duration",
    "EgressRule",
    "EnforcementPlan",
    "EnvVar",
    "FieldPath",
    "Filesystem",
    "FilesystemPlan",
    "Gpu",
    "GpuLimits",
    "IncludeCode",
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
    "SecretInjection",
    "SecurityPolicy",
    "SemanticMatch",
    "SemanticPlanRule",
    "SemanticRule",
    "Severity",
    "SourceMap",
    "SpecError",
    "SpecResult",
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
