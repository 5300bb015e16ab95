"""The sandbox spec (version 1.2) as frozen pydantic models.

Every model forbids unknown fields (the loader turns those into "did you mean" errors) and every
check raises :func:`~dsec_core.spec.errors.invalid` with a hint saying what would be valid.
Defaults are documented on the fields; they are what the compiled plan enforces when a field is
left out.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
import shlex
from collections.abc import Mapping
from datetime import timedelta
from typing import Annotated, Any, Literal, Self

from packaging.markers import InvalidMarker, Marker
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dsec_core.spec.errors import invalid
from dsec_core.spec.units import ByteSize, Cores, Duration, Rate, type_name

CURRENT_VERSION = "1.2"

DEFAULT_VAULT_KEY = "value"
"""Field read from a Vault secret whose source has no ``#key`` (the ``vault kv put PATH value=...``
convention), so ``vault://prod/agent-tools/websearch-key`` reads field ``value``."""

_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
_HOST_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PACKAGE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_VAULT = re.compile(r"vault://([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*)(?:#(.+))?")
_S3 = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(.*)")
_CONFIGMAP = re.compile(r"configmap://([a-z0-9](?:[-a-z0-9.]*[a-z0-9])?)/([-._A-Za-z0-9]+)")
_IMAGE = re.compile(r"[a-z0-9][a-z0-9._/-]*(?::[A-Za-z0-9_.-]{1,128})?(?:@sha256:[0-9a-f]{64})?")

NAME_HINT = (
    "a DNS label: lowercase letters, digits and '-', 1-63 characters, starting and ending with a "
    "letter or digit, e.g. websearch-agent"
)
VAULT_HINT = "vault://MOUNT/PATH[#KEY], e.g. vault://secret/default/agent-tools/websearch#key"
MOUNT_SOURCE_HINT = "s3://BUCKET/PREFIX/ or configmap://NAME/KEY"


class SpecModel(BaseModel):
    """Base of every spec model: immutable, unknown fields rejected.

    Rules between fields ("exactly one of domain or cidr") live in :meth:`cross_checks`, written
    against plain field values so the loader can also run them on the raw YAML of a mapping whose
    other fields failed validation (pydantic skips after-validators then); that way every error
    is reported at once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        """Problems between fields; ``fields`` holds only the fields that were written."""
        return []

    @model_validator(mode="after")
    def _run_cross_checks(self) -> Self:
        written = {name: getattr(self, name) for name in self.model_fields_set}
        problems = type(self).cross_checks(written)
        if problems:
            raise problems[0]
        return self


# -- shared field types -------------------------------------------------------------------------


def _absolute_path(value: str) -> str:
    if not value.startswith("/"):
        raise invalid(f"path {value!r} is relative", "an absolute path such as /workspace/output")
    if ".." in value.split("/"):
        raise invalid(f"path {value!r} contains '..'", "an absolute path without '..'")
    return posixpath.normpath(value).replace("//", "/")


AbsPath = Annotated[str, AfterValidator(_absolute_path)]
"""An absolute POSIX path, normalized (no ``..``, no trailing slash)."""


def _non_empty(value: str) -> str:
    if not value.strip():
        raise invalid("must not be empty")
    return value


NonEmptyStr = Annotated[str, AfterValidator(_non_empty)]


def _argv(value: object) -> object:
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise invalid(f"cannot split {value!r} into arguments: {exc}", _ARGV_HINT) from None
    return value


_ARGV_HINT = 'a command string such as "python agent.py" or a list such as [python, agent.py]'


def _argv_not_empty(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise invalid("the command is empty", _ARGV_HINT)
    return value


Argv = Annotated[tuple[str, ...], BeforeValidator(_argv), AfterValidator(_argv_not_empty)]
"""A command: a string (split like a shell would, without running one) or an argv list."""


# -- dependencies --------------------------------------------------------------------------------


class Dependency(SpecModel):
    """A Python package and the PEP 440 range of versions the agent accepts."""

    package: str = Field(description="Distribution name", examples=["transformers"])
    version: str = Field(
        default="", description="PEP 440 specifier set; empty means any", examples=[">=4.40,<4.42"]
    )
    extras: tuple[str, ...] = Field(default=(), description="Extras to install, e.g. [http2]")
    markers: str | None = Field(default=None, description="PEP 508 environment marker")

    @field_validator("package")
    @classmethod
    def _package_name(cls, value: str) -> str:
        if not _PACKAGE.fullmatch(value):
            raise invalid(
                f"{value!r} is not a package name",
                "letters, digits, '.', '_' and '-', e.g. langchain-core "
                "(put the version range in `version:`)",
            )
        return value

    @field_validator("version")
    @classmethod
    def _specifier(cls, value: str) -> str:
        try:
            return str(SpecifierSet(value))
        except InvalidSpecifier:
            raise invalid(
                f"{value!r} is not a PEP 440 version specifier",
                'comma-separated clauses such as ">=4.40.0,<4.42.0", "==0.6.1" or "~=2.1"',
            ) from None

    @field_validator("extras")
    @classmethod
    def _extras(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for extra in value:
            if not _PACKAGE.fullmatch(extra):
                raise invalid(f"{extra!r} is not an extra name", "a name such as http2 or socks")
        return value

    @field_validator("markers")
    @classmethod
    def _markers(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return str(Marker(value))
        except InvalidMarker as exc:
            raise invalid(
                f"{value!r} is not a PEP 508 marker: {exc}",
                "e.g. sys_platform == 'linux' and python_version >= '3.11'",
            ) from None

    @property
    def canonical_name(self) -> str:
        """PEP 503 normalized name (``Langchain_Core`` -> ``langchain-core``)."""
        return canonicalize_name(self.package)


# -- resources -----------------------------------------------------------------------------------


class Gpu(SpecModel):
    """GPUs the sandbox needs."""

    count: int = Field(default=1, ge=1, le=64, description="Number of GPUs (or slices)")
    memory: ByteSize | None = Field(default=None, description="Minimum memory per GPU")
    type: str | None = Field(default=None, description="GPU model, e.g. a100, h100, mi300x")

    @field_validator("type")
    @classmethod
    def _gpu_type(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", value):
            raise invalid(f"{value!r} is not a GPU type", "lowercase model name: a100, h100, l4")
        return value


class Resources(SpecModel):
    """Limits enforced by cgroups and the node agent. Defaults: 1 CPU, 2 GiB memory, 1024
    processes, no GPU, 1024 open files, 256 MiB of disk for the writable directories, 64 MiB of
    each output log. The node's operator maxima (``DSEC_SANDBOX_MAX_*``) cap what a spec asks."""

    cpu: Cores = Field(default=1.0, description="CPU cores (2, 0.5 or 500m)")
    memory: ByteSize = Field(default=2 * 2**30, description="Memory limit, e.g. 512MiB")
    pids: int = Field(default=1024, ge=1, le=4_194_304, description="Maximum processes/threads")
    gpu: Gpu | None = None
    files: int = Field(
        default=1024, ge=64, le=1_048_576, description="Open files per process (RLIMIT_NOFILE)"
    )
    disk: ByteSize = Field(
        default=256 * 2**20,
        ge=16 * 2**20,
        description="Quota of the writable directories (write_allowed, /tmp excepted), e.g. 1GiB",
    )
    log_bytes: ByteSize = Field(
        default=64 * 2**20,
        ge=64 * 2**10,
        description="Bytes kept of stdout and of stderr each (head and tail), e.g. 64MiB",
    )


# -- runtime context -----------------------------------------------------------------------------


class VaultRef(SpecModel):
    """A parsed ``vault://MOUNT/PATH[#KEY]`` reference (KV v2 mount, secret path, field)."""

    mount: str
    path: str
    key: str


def parse_vault_ref(value: str) -> VaultRef:
    """Parse ``vault://secret/default/agent-tools/websearch#key``; ``#key`` defaults to ``value``.

    Raises:
        PydanticCustomError: the reference is malformed.
    """
    match = _VAULT.fullmatch(value)
    if match is None:
        raise invalid(f"{value!r} is not a Vault reference", VAULT_HINT)
    mount, path, key = match.groups()
    if key is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", key):
        raise invalid(f"{key!r} is not a secret field name", "letters, digits, '_', '.', '-'")
    return VaultRef(mount=mount, path=path, key=key or DEFAULT_VAULT_KEY)


class EnvVar(SpecModel):
    """An environment variable: a literal ``value`` or a secret ``source`` with a ``ttl``.

    A secret's ``ttl`` defaults to 1h: the lease the injector asks Vault for.
    """

    name: str = Field(examples=["WEB_SEARCH_KEY"])
    value: str | None = None
    source: str | None = Field(
        default=None, examples=["vault://secret/default/agent-tools/websearch#key"]
    )
    ttl: Duration | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _ENV_NAME.fullmatch(value):
            raise invalid(
                f"{value!r} is not an environment variable name",
                "letters, digits and '_', not starting with a digit, e.g. WEB_SEARCH_KEY",
            )
        return value

    @field_validator("source")
    @classmethod
    def _source(cls, value: str | None) -> str | None:
        if value is not None:
            parse_vault_ref(value)
        return value

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        """Exactly one of value/source; ttl only with a source."""
        has_value = fields.get("value") is not None
        has_source = fields.get("source") is not None
        problems = []
        if has_value == has_source:
            problems.append(
                invalid(
                    "an env var needs exactly one of `value` or `source`",
                    "value: a literal, or source: vault://MOUNT/PATH[#KEY] with ttl: 2h",
                )
            )
        if fields.get("ttl") is not None and has_value and not has_source:
            problems.append(invalid("`ttl` applies to a secret `source` only", loc=("ttl",)))
        return problems

    @property
    def vault(self) -> VaultRef | None:
        """The parsed secret reference, or ``None`` for a literal value."""
        return parse_vault_ref(self.source) if self.source is not None else None

    @property
    def effective_ttl(self) -> timedelta:
        """The lease to request for a secret: ``ttl`` or 1h."""
        return self.ttl or timedelta(hours=1)


class MountSource(SpecModel):
    """A parsed mount source: ``s3`` (bucket + prefix) or ``configmap`` (name + key)."""

    scheme: Literal["s3", "configmap"]
    bucket: str | None = None
    prefix: str | None = None
    name: str | None = None
    key: str | None = None


def parse_mount_source(value: str) -> MountSource:
    """Parse ``s3://bucket/prefix/`` or ``configmap://name/key``.

    Raises:
        PydanticCustomError: the source is malformed or of an unknown scheme.
    """
    if value.startswith("s3://"):
        match = _S3.fullmatch(value)
        if match is None:
            raise invalid(
                f"{value!r} is not an S3 prefix",
                "s3://BUCKET/PREFIX/ with a bucket of 3-63 lowercase letters, digits, '.', '-'",
            )
        prefix = match.group(2)
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return MountSource(scheme="s3", bucket=match.group(1), prefix=prefix)
    if value.startswith("configmap://"):
        match = _CONFIGMAP.fullmatch(value)
        if match is None:
            raise invalid(f"{value!r} is not a config map key", "configmap://NAME/KEY")
        return MountSource(scheme="configmap", name=match.group(1), key=match.group(2))
    raise invalid(f"{value!r} has an unknown scheme", MOUNT_SOURCE_HINT)


class Mount(SpecModel):
    """Data mounted into the sandbox. ``cache_ttl`` unset means no local cache."""

    path: AbsPath = Field(examples=["/workspace/data"])
    source: str = Field(examples=["s3://ds-bucket/finetune-datasets/v2/"])
    mode: Literal["ro", "ro-encrypted", "rw"] = "ro"
    cache_ttl: Duration | None = None

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        parse_mount_source(value)
        return value

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        """A config map can only be mounted read-only."""
        source, mode = fields.get("source"), fields.get("mode", "ro")
        if isinstance(source, str) and source.startswith("configmap://") and mode != "ro":
            return [
                invalid(
                    f"a config map mount is read-only; mode {mode!r} is not possible",
                    "mode: ro",
                    loc=("mode",),
                )
            ]
        return []

    @property
    def parsed_source(self) -> MountSource:
        """The source split into its parts."""
        return parse_mount_source(self.source)


class RuntimeContext(SpecModel):
    """What is injected before start: environment variables and mounts."""

    env_vars: tuple[EnvVar, ...] = ()
    mounts: tuple[Mount, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> RuntimeContext:
        _no_duplicates([e.name for e in self.env_vars], "env_vars", "name", "env var")
        _no_duplicates([m.path for m in self.mounts], "mounts", "path", "mount path")
        return self


def _no_duplicates(values: list[str], field: str, sub: str, what: str) -> None:
    seen: set[str] = set()
    for index, value in enumerate(values):
        if value in seen:
            raise invalid(
                f"duplicate {what} {value!r}", f"each {what} once", loc=(field, index, sub)
            )
        seen.add(value)


# -- security policy -----------------------------------------------------------------------------


def normalize_domain(value: str) -> str:
    """Lower-case a domain, drop a trailing dot, check labels; ``*`` and ``*.x`` allowed.

    Raises:
        PydanticCustomError: the domain is malformed.
    """
    domain = value.strip().lower().rstrip(".")
    if domain == "*":
        return domain
    bare = domain[2:] if domain.startswith("*.") else domain
    if not bare or not _HOSTNAME.fullmatch(bare):
        raise invalid(
            f"{value!r} is not a domain",
            "an exact name such as api.example.com or a wildcard such as *.example.com "
            "('*' only as the whole first label)",
        )
    return domain


def _port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise invalid(f"port {value} is out of range", "a TCP/UDP port from 1 to 65535")
    return value


Port = Annotated[int, AfterValidator(_port)]
Transport = Literal["tcp", "udp"]


class EgressRule(SpecModel):
    """One allowed destination: exactly one of ``domain`` or ``cidr``. Ports default to [443]."""

    domain: str | None = Field(default=None, examples=["api.websearch.com"])
    cidr: str | None = Field(default=None, examples=["10.0.0.0/8"])
    ports: tuple[Port, ...] = Field(default=(443,), min_length=1)
    rate_limit: Rate | None = None
    allow_internal_only: bool = Field(
        default=False,
        description="Only private (RFC 1918/4193, loopback) addresses; the one way a domain "
        "rule's DNS answers may point at loopback or this node",
    )
    protocol: Transport | None = Field(
        default=None, description="Transport this rule opens (default tcp); or `protocols`"
    )
    protocols: tuple[Transport, ...] | None = Field(
        default=None, min_length=1, description="Transports this rule opens, e.g. [tcp, udp]"
    )
    tls_proxy: bool = Field(
        default=False,
        description="Reach this domain only through the node agent's HTTPS proxy, which counts "
        "every HTTP request against the rule's `requests` rate limit (any client, also "
        "pipelined requests on one connection); needs a domain and a requests rate limit",
    )

    @property
    def transports(self) -> tuple[Transport, ...]:
        """The transports this rule opens: ``protocols``, ``protocol``, or TCP alone."""
        if self.protocols is not None:
            return tuple(sorted(set(self.protocols)))
        return (self.protocol,) if self.protocol is not None else ("tcp",)

    @field_validator("domain")
    @classmethod
    def _domain(cls, value: str | None) -> str | None:
        return None if value is None else normalize_domain(value)

    @field_validator("cidr")
    @classmethod
    def _cidr(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return str(ipaddress.ip_network(value, strict=True))
        except ValueError as exc:
            raise invalid(
                f"{value!r} is not a network: {exc}",
                "an address or network such as 10.0.0.0/8, 192.168.1.7 or fd00::/8",
            ) from None

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        """Exactly one destination; at most one of ``protocol`` and ``protocols``."""
        errors = []
        if (fields.get("domain") is None) == (fields.get("cidr") is None):
            errors.append(
                invalid(
                    "an egress rule needs exactly one of `domain` or `cidr`",
                    "domain: api.example.com  (or)  cidr: 10.0.0.0/8",
                )
            )
        if fields.get("protocol") is not None and fields.get("protocols") is not None:
            errors.append(
                invalid(
                    "an egress rule takes `protocol` or `protocols`, not both",
                    "protocol: udp  (or)  protocols: [tcp, udp]",
                )
            )
        return errors

    @model_validator(mode="after")
    def _tls_proxy(self) -> EgressRule:
        if not self.tls_proxy:
            return self
        if self.domain is None:
            raise invalid(
                "tls_proxy needs a domain rule: the proxy sees host names, not networks",
                "domain: api.example.com, tls_proxy: true, rate_limit: 100requests/min",
                loc=("tls_proxy",),
            )
        if self.rate_limit is None or self.rate_limit.unit != "requests":
            raise invalid(
                "tls_proxy counts requests: it needs a rate_limit in requests",
                "rate_limit: 100requests/min (or 10req/s)",
                loc=("rate_limit",),
            )
        return self

    @model_validator(mode="after")
    def _internal_network(self) -> EgressRule:
        if (
            self.cidr
            and self.allow_internal_only
            and not ipaddress.ip_network(self.cidr).is_private
        ):
            raise invalid(
                f"allow_internal_only is set but {self.cidr} is a public network",
                "a private network (10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, fd00::/8)",
                loc=("cidr",),
            )
        return self


class Network(SpecModel):
    """Network egress allow-list (everything else is denied)."""

    egress: tuple[EgressRule, ...] = ()


class Filesystem(SpecModel):
    """Paths the agent may read and write besides its code (Landlock rules)."""

    read_allowed: tuple[AbsPath, ...] = ()
    write_allowed: tuple[AbsPath, ...] = ()


_MATCH_KEYS: dict[str, tuple[str, ...]] = {
    "open": ("path",),
    "subprocess": ("argv",),
    "connect": ("host",),
    "http": ("url", "host"),
}


class SemanticMatch(SpecModel):
    """What a semantic rule matches; glob patterns (``*``, ``?``, ``[...]``)."""

    path: str | None = Field(default=None, examples=["/etc/*"])
    argv: tuple[str, ...] | None = Field(default=None, examples=[["curl", "*"]])
    host: str | None = Field(default=None, examples=["*.example.com"])
    url: str | None = Field(default=None, examples=["https://api.example.com/v1/*"])

    @field_validator("argv", mode="before")
    @classmethod
    def _argv_text(cls, value: object) -> object:
        return _argv(value)


class SemanticRule(SpecModel):
    """A call the in-process layer intercepts: on what, matching what, doing what."""

    on: Literal["open", "subprocess", "connect", "http"]
    match: SemanticMatch
    action: Literal["allow", "redirect", "log", "deny"]
    target: str | None = Field(default=None, description="Where a redirect goes")
    message: str | None = Field(default=None, description="Shown to the agent on deny")

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        """The match fits `on`; a redirect has a target and only a redirect has one."""
        return _match_problems(fields) + _target_problems(fields)

    @model_validator(mode="after")
    def _redirect_path(self) -> SemanticRule:
        if self.action == "redirect" and self.on == "open" and self.target:
            try:
                _absolute_path(self.target)
            except PydanticCustomError as exc:
                raise invalid(
                    str(exc), "an absolute path such as /tmp/sandbox", ("target",)
                ) from None
        return self


def _match_problems(fields: Mapping[str, Any]) -> list[PydanticCustomError]:
    on, match = fields.get("on"), fields.get("match")
    if on not in _MATCH_KEYS or match is None:
        return []
    if isinstance(match, BaseModel):
        match = match.model_dump(exclude_none=True)
    if not isinstance(match, dict):
        return []
    allowed = _MATCH_KEYS[on]
    used = [k for k in match if k in ("path", "argv", "host", "url") and match[k] is not None]
    if not used:
        hint = f"match on {' or '.join(allowed)}"
        return [invalid(f"the match of an `on: {on}` rule is empty", hint, ("match",))]
    return [
        invalid(
            f"`on: {on}` cannot match on {key!r}",
            f"match on {' or '.join(allowed)}",
            ("match", key),
        )
        for key in used
        if key not in allowed
    ][:1]


def _target_problems(fields: Mapping[str, Any]) -> list[PydanticCustomError]:
    action, target, on = fields.get("action"), fields.get("target"), fields.get("on")
    if action == "redirect":
        if on == "subprocess":
            return [invalid("a subprocess cannot be redirected", "allow, log or deny", ("action",))]
        if not target:
            return [
                invalid(
                    "`action: redirect` needs a `target`",
                    "target: a path (open), a URL (http) or host:port (connect)",
                )
            ]
    elif target is not None and action in ("allow", "log", "deny"):
        return [
            invalid(f"`target` only applies to `action: redirect`, not {action!r}", loc=("target",))
        ]
    return []


class SecurityPolicy(SpecModel):
    """What the kernel and semantic layers allow. Everything not granted is denied."""

    dns_passthrough: bool = Field(default=False, description="Resolve via the host's resolver")
    network: Network = Network()
    filesystem: Filesystem = Filesystem()
    semantic: tuple[SemanticRule, ...] = ()


#: Default and ceiling of ``include_code.max_size`` (the code bundle's size once extracted).
CODE_MAX_SIZE_DEFAULT = 256 * 2**20
CODE_MAX_SIZE_LIMIT = 4 * 2**30


class IncludeCode(SpecModel):
    """What of the code directory goes into the bundle."""

    exclude_patterns: tuple[NonEmptyStr, ...] = ()
    max_size: ByteSize = Field(
        default=CODE_MAX_SIZE_DEFAULT,
        description="Largest size of the code once extracted (files added up; sparse files "
        "count their full size); at most 4GiB",
        examples=["200MiB"],
    )

    @field_validator("max_size")
    @classmethod
    def _max_size(cls, value: int) -> int:
        if value > CODE_MAX_SIZE_LIMIT:
            raise invalid(f"{value} bytes is over the limit", "at most 4GiB")
        return value


# -- the spec ------------------------------------------------------------------------------------


def _version(value: object) -> object:
    # `version: 1.2` unquoted is a YAML float; the migration step has already checked it.
    return str(value) if isinstance(value, float) else value


class SandboxSpec(SpecModel):
    """A sandbox spec, version 1.2 (older versions are migrated by the loader)."""

    version: Annotated[Literal["1.2"], BeforeValidator(_version)] = Field(examples=["1.2"])
    name: str = Field(examples=["websearch-agent"])
    task_group: str | None = Field(
        default=None,
        description="Agents of one task group call each other's tools by name (DSecClient); "
        "unset: a group of its own, named after the sandbox",
        examples=["research-team"],
    )
    base: str = Field(examples=["dsec/python311:latest"])
    entrypoint: Argv | None = Field(default=None, description="Command run in workdir")
    workdir: AbsPath = Field(default="/workspace", description="Where the code bundle lands")
    dependencies: tuple[Dependency, ...] = ()
    build_options: tuple[NonEmptyStr, ...] = ()
    resources: Resources = Resources()
    timeout: Duration | None = Field(default=None, description="Wall-clock limit; unset: none")
    runtime_context: RuntimeContext = RuntimeContext()
    security_policy: SecurityPolicy = SecurityPolicy()
    include_code: IncludeCode = IncludeCode()

    @field_validator("name", "task_group")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not _DNS_LABEL.fullmatch(value):
            suggestion = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:63].strip("-")
            hint = NAME_HINT + (f"; did you mean {suggestion!r}?" if suggestion else "")
            raise invalid(f"{value!r} is not a valid name", hint)
        return value

    @field_validator("base")
    @classmethod
    def _base(cls, value: str) -> str:
        if not _IMAGE.fullmatch(value):
            raise invalid(
                f"{value!r} is not a base image reference",
                "NAME[:TAG][@sha256:DIGEST] in lowercase, e.g. dsec/python311-cu121:latest",
            )
        return value

    @field_validator("dependencies")
    @classmethod
    def _unique_packages(cls, value: tuple[Dependency, ...]) -> tuple[Dependency, ...]:
        seen: dict[str, int] = {}
        for index, dep in enumerate(value):
            if dep.canonical_name in seen:
                raise invalid(
                    f"package {dep.package!r} is listed twice (also at dependencies"
                    f"[{seen[dep.canonical_name]}])",
                    'merge the version ranges into one entry, e.g. version: ">=1.0,<2"',
                    loc=(index, "package"),
                )
            seen[dep.canonical_name] = index
        return value


def model_field_names(model: type[BaseModel]) -> list[str]:
    """Field names of a spec model, in declaration order (for hints)."""
    return list(model.model_fields)


def describe(value: Any) -> str:
    """Short description of a YAML value for messages: type and, for scalars, the value."""
    if isinstance(value, dict | list):
        return type_name(value)
    text = repr(value)
    return f"{type_name(value)} {text if len(text) <= 40 else text[:37] + '...'}"
