"""The sandbox spec (version 1.2) as frozen pydantic models.

Every model forbids unknown fields (the loader turns those into "did you mean" errors) and every
check raises :func:`~dsec_core.spec.errors.invalid` with a hint saying what would be valid.
Defaults are documented on the fields; they are what the compiled plan enforces when a field is
left out.
"""

from __future__ import annotations

import ipaddress
import math
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
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
    PlainSerializer,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dsec_core import gpumodels
from dsec_core.spec.errors import invalid
from dsec_core.spec.units import (
    Bandwidth,
    ByteRate,
    ByteSize,
    Cores,
    Duration,
    GpuShare,
    Rate,
    Tflops,
    format_duration,
    format_size,
    parse_duration,
    type_name,
)

CURRENT_VERSION = "1.2"

DEFAULT_VAULT_KEY = "value"
"""Field read from a Vault secret whose source has no ``#key`` (the ``vault kv put PATH value=...``
convention), so ``vault://prod/agent-tools/websearch-key`` reads field ``value``."""

_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
_HOST_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SANDBOX_OWNED_ENV = ("PYTHONUSERBASE", "PYTHONNOUSERSITE")
"""Environment variables a spec may not set: the node agent sets them in every sandbox."""
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


def _workdir(value: str) -> str:
    if value == "/":
        raise invalid(
            "the workdir cannot be / (the sandbox's root is its runtime's, read-only; and every "
            "path would lie inside the workdir)",
            "a directory of its own, such as /workspace",
        )
    return value


WorkDir = Annotated[str, AfterValidator(_absolute_path), AfterValidator(_workdir)]
"""Where the code lands: an absolute path, never ``/``."""


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
    each output log, block I/O of 256 MiB/s read, 128 MiB/s written and 4096 operations/s each
    way. The node's operator maxima (``DSEC_SANDBOX_MAX_*``) cap what a spec asks."""

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
    disk_read_rate: ByteRate = Field(
        default=256 * 2**20,
        ge=2**20,
        description="Bytes per second the sandbox may read from block devices (its disk, the "
        "host's disks under its read-only views), e.g. 256MiB/s",
    )
    disk_write_rate: ByteRate = Field(
        default=128 * 2**20,
        ge=2**20,
        description="Bytes per second written to its disk (resources.disk), e.g. 128MiB/s",
    )
    disk_iops: int = Field(
        default=4096,
        ge=64,
        le=10_000_000,
        description="Block I/O operations per second, reads and writes each",
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
        if value in SANDBOX_OWNED_ENV:
            raise invalid(
                f"{value} is set by DSec in every sandbox: the sandbox's Python loads DSec's "
                "user site, which adds the built environment's packages and the semantic layer",
                f"remove {value}; put your own modules on PYTHONPATH instead",
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


RESERVED_DIR = "/dsec"
"""Where DSec puts a sandbox's own files (``/dsec/recording``, ``/dsec/replay``): no spec mount
may cover it."""


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
        """A config map can only be mounted read-only; nothing is mounted over ``/dsec``."""
        found: list[PydanticCustomError] = []
        source, mode = fields.get("source"), fields.get("mode", "ro")
        if isinstance(source, str) and source.startswith("configmap://") and mode != "ro":
            found.append(
                invalid(
                    f"a config map mount is read-only; mode {mode!r} is not possible",
                    "mode: ro",
                    loc=("mode",),
                )
            )
        path = fields.get("path")
        if isinstance(path, str) and (
            path.rstrip("/") in ("", RESERVED_DIR) or path.startswith(RESERVED_DIR + "/")
        ):
            found.append(
                invalid(
                    f"{path!r} is in or over {RESERVED_DIR}, where DSec puts a sandbox's recorded "
                    "and replayed calls",
                    "a path outside /dsec, e.g. /workspace/data",
                    loc=("path",),
                )
            )
        return found

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


_V4_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
LINK_LOCAL = (ipaddress.IPv4Network("169.254.0.0/16"), ipaddress.IPv6Network("fe80::/10"))
"""Never granted: a ``cidr`` rule inside them is refused, and the node agent leaves them out
of every wider rule (cloud metadata services answer there)."""


def canonical_network(
    network: ipaddress.IPv4Network | ipaddress.IPv6Network,
) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """An IPv6 range inside ``::ffff:0:0/96`` as the IPv4 range it denotes: the kernel judges
    v4-mapped destinations by the IPv4 rules, so the spec (and every check of it: the org's
    rules, the stack's endpoints) sees the rule as the IPv4 range it opens. Before,
    ``::ffff:0:0/96`` passed the rule against egress to everywhere and opened 0.0.0.0/0."""
    if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(_V4_MAPPED):
        base = network.network_address.ipv4_mapped
        assert base is not None  # guaranteed by subnet_of(::ffff:0:0/96)
        return ipaddress.IPv4Network((base, network.prefixlen - 96))
    return network


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
            network = canonical_network(ipaddress.ip_network(value, strict=True))
        except ValueError as exc:
            raise invalid(
                f"{value!r} is not a network: {exc}",
                "an address or network such as 10.0.0.0/8, 192.168.1.7 or fd00::/8",
            ) from None
        for link_local in LINK_LOCAL:
            if network.version == link_local.version and network.subnet_of(link_local):  # type: ignore[arg-type]
                raise invalid(
                    f"{value!r} is in the link-local range {link_local}, where a cloud "
                    "machine's metadata service answers (169.254.169.254: its credentials); "
                    "a sandbox is never granted it (a wider rule opens everything around it)",
                    "a network outside 169.254.0.0/16 and fe80::/10",
                )
        return str(network)

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


# -- task topology -------------------------------------------------------------------------------

MAX_DERIVED_GPUS = 8
"""Most GPUs a throughput or bandwidth need may turn into for one unit (one node's worth)."""

DEFAULT_TASKS_BASE = "dsec/python311:latest"
"""The base image of a spec with ``tasks:`` that names none."""

LinkProtocol = Literal["nvlink-p2p", "rdma-over-converged-ethernet", "shm"]
LINK_PROTOCOLS: tuple[str, ...] = ("nvlink-p2p", "rdma-over-converged-ethernet", "shm")

_GPU_TYPE_HINT_HEAD = "a GPU model or family, or a list of acceptable ones"


def _known_models_hint() -> str:
    return f"{_GPU_TYPE_HINT_HEAD}; known: {', '.join(gpumodels.known_names())}"


def _resolve_one(name: object, loc: tuple[str | int, ...]) -> tuple[str, ...]:
    if not isinstance(name, str):
        raise invalid(
            f"expected a GPU model name, got {type_name(name)}", _known_models_hint(), loc
        )
    try:
        return gpumodels.resolve(name)
    except KeyError:
        raise invalid(f"unknown GPU model {name!r}", _known_models_hint(), loc) from None


def _gpu_types(value: object) -> object:
    """``gpu_type``: one name or a list of names, each a known model or family."""
    if isinstance(value, str):
        _resolve_one(value, ())
        return (value,)
    if isinstance(value, list | tuple):
        if not value:
            raise invalid("the list of GPU models is empty", _known_models_hint())
        for index, name in enumerate(value):
            _resolve_one(name, (index,))
        return tuple(value)
    raise invalid(f"expected a GPU model or a list of them, got {type_name(value)}", None)


GpuTypes = Annotated[tuple[str, ...], BeforeValidator(_gpu_types)]
"""Acceptable GPU models as written (``a100`` or ``[h100, h200]``), each known to the catalogue."""


def accepted_models(names: tuple[str, ...] | None) -> tuple[gpumodels.GpuModel, ...]:
    """The catalogue models the written names accept, in catalogue order (unknown names skipped)."""
    wanted: set[str] = set()
    for name in names or ():
        try:
            wanted.update(gpumodels.resolve(name))
        except KeyError:
            continue
    return tuple(m for m in gpumodels.CATALOG if m.name in wanted)


def _label(value: str | None) -> str | None:
    if value is not None and not _DNS_LABEL.fullmatch(value):
        raise invalid(f"{value!r} is not a valid name", NAME_HINT)
    return value


Label = Annotated[str, AfterValidator(_label)]


def _percent(value: object) -> object:
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1].strip()
        try:
            return float(text)
        except ValueError:
            raise invalid(
                f"{value!r} is not a percentage", "a number from 1 to 100, e.g. 70"
            ) from None
    return value


Percent = Annotated[float, BeforeValidator(_percent), Field(ge=1, le=100)]
Celsius = Annotated[float, Field(ge=30, le=110)]


@dataclass(frozen=True)
class GpuNeeds:
    """What a compute unit asks of GPUs once its needs are resolved against the catalogue."""

    models: tuple[str, ...] = ()
    """Acceptable canonical models (empty: any model, or no GPU)."""
    gpus: int = 0
    """Whole GPUs (0: none, or a share)."""
    gpu_milli: int = 0
    """A share of one GPU in thousandths (0: none, or whole GPUs)."""
    min_memory_bytes: int = 0

    @property
    def any_gpu(self) -> bool:
        """Whether the unit takes a GPU at all."""
        return self.gpus > 0 or self.gpu_milli > 0


def _bytes_text(size: int) -> str:
    """A size as written most likely: GiB when exact, else decimal GB."""
    return format_size(size) if size % 2**20 == 0 else f"{size / 10**9:g}GB"


def _figure_text(value: float) -> str:
    return f"{value:g}"


class ComputeUnit(SpecModel):
    """The hardware one task runs on: GPU models and count (or a share), needs that become a
    GPU count, CPU and memory (default: the spec's ``resources``)."""

    gpu_type: GpuTypes | None = Field(
        default=None,
        description="Acceptable GPU model(s): a family (a100) or a model (A100-80GB), or a list",
        examples=["h100"],
    )
    gpus: int | None = Field(
        default=None, ge=1, le=64, description="Whole GPUs; unset: 1, or derived from the needs"
    )
    gpu_share: GpuShare | None = Field(
        default=None, description="A share of one GPU: 250m, 0.25 or 25%", examples=["250m"]
    )
    min_memory: ByteSize | None = Field(
        default=None, description="Memory each GPU must have, e.g. 64GB", examples=["64GB"]
    )
    nvlink_affinity: Label | None = Field(
        default=None, description="NVLink group label: the unit's GPUs share one NVLink domain"
    )
    fp16_throughput: Tflops | None = Field(
        default=None, description="Dense FP16 need, e.g. 2000 TFLOPS", examples=["2000 TFLOPS"]
    )
    memory_bandwidth: Bandwidth | None = Field(
        default=None, description="Memory bandwidth need, e.g. 3.2 TB/s", examples=["3.2 TB/s"]
    )
    cpu: Cores | None = Field(default=None, description="CPU cores; unset: resources.cpu")
    memory: ByteSize | None = Field(default=None, description="Memory; unset: resources.memory")
    max_temperature_c: Celsius | None = Field(
        default=None, description="Hottest GPU the unit may run on; unset: migration's"
    )

    @model_validator(mode="after")
    def _feasible(self) -> ComputeUnit:
        self.gpu_needs()
        return self

    def gpu_needs(self) -> GpuNeeds:
        """Resolve the unit's GPU needs: acceptable models, whole GPUs or a share.

        Raises:
            PydanticCustomError: the combination is impossible (located at the field to change).
        """
        wants = (
            self.gpu_type,
            self.gpus,
            self.gpu_share,
            self.min_memory,
            self.fp16_throughput,
            self.memory_bandwidth,
            self.nvlink_affinity,
        )
        if all(value is None for value in wants):
            return GpuNeeds()
        if self.gpu_share is not None and self.gpus is not None and self.gpus > 1:
            raise invalid(
                f"gpu_share is a share of one GPU; it cannot go with gpus: {self.gpus}",
                "either gpu_share: 250m (part of one GPU) or gpus: N (whole GPUs)",
                ("gpu_share",),
            )
        written = accepted_models(self.gpu_type)
        candidates = written
        min_memory = self.min_memory or 0
        if min_memory:
            candidates = self._with_memory(written, min_memory)
        if self.nvlink_affinity is not None and candidates:
            linked = tuple(m for m in candidates if m.nvlink)
            if not linked:
                raise invalid(
                    "nvlink_affinity needs GPUs with NVLink; "
                    f"{', '.join(m.name for m in candidates)} have none",
                    "drop nvlink_affinity, or accept models with NVLink: "
                    + ", ".join(m.name for m in gpumodels.CATALOG if m.nvlink),
                    ("nvlink_affinity",),
                )
            candidates = linked
        names = tuple(m.name for m in candidates)
        if self.gpu_share is not None:
            if self.gpu_share == 1000:
                return GpuNeeds(names, 1, 0, min_memory)
            return GpuNeeds(names, 0, self.gpu_share, min_memory)
        per_need = self._counts(candidates)
        if self.gpus is not None:
            for field, need, count, weakest, figure, unit in per_need:
                if self.gpus < count:
                    raise invalid(
                        f"{field} {_figure_text(need)} {unit} needs {count} × {weakest} "
                        f"({_figure_text(figure)} {unit} each); gpus: {self.gpus} gives "
                        f"{_figure_text(self.gpus * figure)} {unit}",
                        f"gpus: {count} or more, or leave gpus out to derive it",
                        ("gpus",),
                    )
            return GpuNeeds(names, self.gpus, 0, min_memory)
        derived = max((count for _, _, count, _, _, _ in per_need), default=1)
        for field, need, count, weakest, figure, unit in per_need:
            if count > MAX_DERIVED_GPUS:
                raise invalid(
                    f"{field} {_figure_text(need)} {unit} needs {count} × {weakest} "
                    f"({_figure_text(figure)} {unit} each), more than {MAX_DERIVED_GPUS} GPUs "
                    "in one unit",
                    f"at most {_figure_text(MAX_DERIVED_GPUS * figure)} {unit} on {weakest}; "
                    "split the work into several tasks, or accept only faster models",
                    (field,),
                )
        return GpuNeeds(names, max(1, derived), 0, min_memory)

    def _with_memory(
        self, written: tuple[gpumodels.GpuModel, ...], min_memory: int
    ) -> tuple[gpumodels.GpuModel, ...]:
        pool = written or tuple(m for m in gpumodels.CATALOG if m.memory_bytes)
        # A model of unknown memory (0) is kept: the node's reported memory decides.
        fits = tuple(m for m in pool if m.memory_bytes == 0 or m.memory_bytes >= min_memory)
        if fits:
            return fits if written else ()
        largest = max(pool, key=lambda m: m.memory_bytes)
        bigger = [m.name for m in gpumodels.CATALOG if m.memory_bytes >= min_memory]
        have = ", ".join(f"{m.name} {format_size(m.memory_bytes)}" for m in pool)
        hint = f"at most {format_size(largest.memory_bytes)} ({largest.name})"
        if bigger:
            hint += f", or a gpu_type with more memory: {', '.join(bigger)}"
        raise invalid(
            f"min_memory {_bytes_text(min_memory)} is more than any accepted GPU has ({have})",
            hint,
            ("min_memory",),
        )

    def _counts(
        self, candidates: tuple[gpumodels.GpuModel, ...]
    ) -> list[tuple[str, float, int, str, float, str]]:
        """Per need: (field, need, GPUs it takes on the weakest accepted model, that model,
        its figure, unit)."""
        out = []
        needs = (
            ("fp16_throughput", self.fp16_throughput, "fp16_tflops", "TFLOPS"),
            ("memory_bandwidth", self.memory_bandwidth, "memory_bandwidth_gbps", "GB/s"),
        )
        for field, need, attr, unit in needs:
            if need is None:
                continue
            if not candidates:
                raise invalid(
                    f"{field} needs a gpu_type to turn into a number of GPUs",
                    f"gpu_type: h100 (or a list of acceptable models), or gpus: N without {field}",
                    (field,),
                )
            unknown = [m.name for m in candidates if not getattr(m, attr)]
            if unknown:
                known = [m.name for m in gpumodels.CATALOG if getattr(m, attr)]
                raise invalid(
                    f"figures unknown for {', '.join(unknown)}: {field} cannot be turned into a "
                    "number of GPUs",
                    f"leave out {field} and give gpus: N, or accept only models with known "
                    f"figures: {', '.join(known)}",
                    (field,),
                )
            figure, _, weakest = min(
                (float(getattr(m, attr)), i, m) for i, m in enumerate(candidates)
            )
            count = max(1, math.ceil(need / figure - 1e-9))
            out.append((field, need, count, weakest.name, figure, unit))
        return out


MAX_TASKS = 256
"""Tasks of one topology at most: each is a unit the scheduler places (and a ``unit.placed``)."""
MAX_LINKS = 1024
"""Links (``communication:``) of one topology at most."""


class Task(SpecModel):
    """One compute unit of a task topology: a name, its hardware, and what it runs."""

    name: str = Field(examples=["embedding-gen"])
    compute_unit: ComputeUnit = ComputeUnit()
    script: Argv | None = Field(
        default=None, description="Command line run in workdir", examples=["python embed.py"]
    )
    entrypoint: Argv | None = Field(default=None, description="Command as an argv list")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _DNS_LABEL.fullmatch(value):
            suggestion = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:63].strip("-")
            hint = NAME_HINT + (f"; did you mean {suggestion!r}?" if suggestion else "")
            raise invalid(f"{value!r} is not a valid task name", hint)
        return value

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        """At most one of script and entrypoint."""
        if fields.get("script") is not None and fields.get("entrypoint") is not None:
            return [
                invalid(
                    "a task takes `script` or `entrypoint`, not both",
                    'script: "python embed.py"  (or)  entrypoint: [python, embed.py]',
                    ("entrypoint",),
                )
            ]
        return []

    @property
    def command(self) -> tuple[str, ...] | None:
        """What the unit runs: ``script`` or ``entrypoint`` as argv."""
        return self.script or self.entrypoint


class Link(SpecModel):
    """A communication edge between two tasks and the transport it needs."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", populate_by_name=True, serialize_by_alias=True
    )

    src: str = Field(alias="from", description="The task it starts at", examples=["embed"])
    to: str = Field(description="The task it reaches", examples=["infer"])
    protocol: LinkProtocol = Field(
        description="nvlink-p2p (one NVLink domain), rdma-over-converged-ethernet, shm (one node)"
    )


MigrationSignal = Literal["temperature", "xid", "ecc", "throttle", "nvlink_errors", "lost"]
"""Health signals that may move a unit (``gpu.degraded``'s signals)."""
DEFAULT_MIGRATION_SIGNALS: tuple[str, ...] = ("temperature", "xid", "ecc", "lost")
"""What moves a unit when its spec does not say (``migration.on`` unset)."""
MigrationPathName = Literal["handover", "criu", "restart"]
"""How a unit may be moved: its state through the state plane, its process tree by CRIU, or
started afresh on the target."""
MAX_INTERRUPTION_MS = 600_000.0


class MigrationThresholds(SpecModel):
    """This unit's own health limits: only ever stricter than the operator's
    (``dsec cluster config``); a looser one is ignored."""

    temperature_c: Celsius | None = Field(default=None, description="°C, 30-110")
    xid_errors: int | None = Field(default=None, ge=1, le=10_000, description="New XIDs")
    ecc_uncorrected: int | None = Field(
        default=None, ge=1, le=10_000, description="New uncorrected ECC errors"
    )
    nvlink_errors: int | None = Field(
        default=None, ge=1, le=10**9, description="New NVLink errors on a link"
    )
    nvlink_utilization_pct: Percent | None = Field(
        default=None, description="NVLink utilization (percent, 1-100) that is congestion"
    )


class Migration(SpecModel):
    """When and how a running unit moves off a degraded GPU (docs/gpu.md, docs/migration.md)."""

    max_temperature_c: Celsius | None = Field(
        default=None, description="Hottest GPU (°C) a unit may stay on, 30-110"
    )
    nvlink_congestion_threshold: Percent | None = Field(
        default=None,
        description="NVLink utilisation (percent, 1-100) above which a unit degrades to PCIe or "
        "moves",
    )
    on: tuple[MigrationSignal, ...] | None = Field(
        default=None,
        description="Signals that move the unit (temperature, xid, ecc, throttle, "
        "nvlink_errors, lost); unset: temperature, xid, ecc and lost (the operator's thresholds, "
        "or this section's); `[]`: never moved automatically",
        examples=[["temperature", "xid"]],
    )
    paths: tuple[MigrationPathName, ...] = Field(
        default=("handover", "criu"),
        min_length=1,
        description="How it may be moved, in order of preference: handover, criu, restart",
    )
    max_interruption_ms: float | None = Field(
        default=None,
        gt=0,
        le=MAX_INTERRUPTION_MS,
        description="Longest pause the unit accepts; a path that cannot promise it is not used",
    )
    thresholds: MigrationThresholds = MigrationThresholds()

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        """Each signal and path once; one temperature limit."""
        problems = []
        for name in ("on", "paths"):
            values = fields.get(name) or ()
            for index, value in enumerate(values):
                if value in values[:index]:
                    problems.append(
                        invalid(
                            f"{value!r} is listed twice",
                            f"list each {name[:-1] if name == 'paths' else 'signal'} once",
                            (name, index),
                        )
                    )
                    break
        thresholds = fields.get("thresholds")
        limit = getattr(thresholds, "temperature_c", None)
        if (
            limit is not None
            and fields.get("max_temperature_c") is not None
            and limit != fields["max_temperature_c"]
        ):
            problems.append(
                invalid(
                    f"two temperature limits: max_temperature_c {fields['max_temperature_c']:g} "
                    f"and thresholds.temperature_c {limit:g}",
                    "give one of them",
                    ("thresholds", "temperature_c"),
                )
            )
        return problems

    @property
    def signals(self) -> tuple[str, ...]:
        """The signals that move the unit (``on``, or its default: the hardware faults a unit
        cannot ride out, as the brief's "a GPU runs hot, its unit moves" asks)."""
        if self.on is not None:
            return self.on
        return DEFAULT_MIGRATION_SIGNALS


class Scheduling(SpecModel):
    """How the scheduler ranks this spec's units against others."""

    priority: int = Field(
        default=0, ge=0, le=1000, description="Higher first; may preempt lower (0-1000)"
    )


# -- the state plane -----------------------------------------------------------------------------

MAX_STATE_TIERS = 1000
"""Container tier overrides (``state.tiers``) of one spec at most."""
MIN_STATE_INTERVAL = timedelta(milliseconds=100)
"""Shortest checkpoint, warm or cold interval: a capture every 100 ms is already a lot."""
MAX_RESTARTS = 100
"""Most restarts ``state.max_restarts`` may allow."""
_CONTAINER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,62}")
CONTAINER_NAME_HINT = (
    "a container name: a letter, then letters, digits, '_', '.' or '-', at most 63 characters, "
    "e.g. history"
)
INTERVAL_HINT = "a duration of at least 100ms such as 500ms, 5s, 5m, 1h"
CHECKPOINT_HINT = (
    "a duration of at least 100ms such as 5s or 500ms, or 0 / off for explicit checkpoints only"
)
ENCRYPTION_HINT = (
    "tenant-key (the only value now: deltas and snapshots are encrypted with the tenant's state "
    "key, kept in OpenBao)"
)
_OFF = timedelta(0)


def _checkpoint_interval(value: object) -> object:
    """``0``, ``"0"``, ``off`` or ``false``: explicit checkpoints only (a zero interval)."""
    if value is False or (
        isinstance(value, int | float) and not isinstance(value, bool) and value == 0
    ):
        return _OFF
    if isinstance(value, str) and value.strip().lower() in {"0", "off", "none", "never"}:
        return _OFF
    if isinstance(value, timedelta) and value == _OFF:
        return _OFF
    return _state_interval(value, CHECKPOINT_HINT)


def _state_interval(value: object, hint: str = INTERVAL_HINT) -> timedelta:
    try:
        interval = parse_duration(value)
    except PydanticCustomError as exc:
        ctx = exc.context or {}
        raise invalid(str(ctx.get("message", exc.message())), hint) from None
    if interval < MIN_STATE_INTERVAL:
        raise invalid(
            f"{format_duration(interval)} is shorter than the shortest interval, 100ms", hint
        )
    return interval


def _format_interval(value: timedelta) -> str:
    return "off" if value == _OFF else format_duration(value)


CheckpointInterval = Annotated[
    timedelta,
    BeforeValidator(_checkpoint_interval),
    PlainSerializer(_format_interval, return_type=str, when_used="json"),
]
"""A checkpoint period of at least 100 ms, or 0/``off`` (a zero timedelta): explicit only."""

StateInterval = Annotated[
    timedelta,
    BeforeValidator(_state_interval),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
"""A period of at least 100 ms."""


def _encryption(value: object) -> object:
    if value != "tenant-key":
        shown = describe(value) if not isinstance(value, str) else repr(value)
        raise invalid(f"{shown} is not a supported encryption", ENCRYPTION_HINT)
    return value


def _raw_interval(value: object, parse: Any) -> timedelta | None:
    """A field's value as a timedelta, from a validated model or raw YAML (None: unreadable)."""
    if isinstance(value, timedelta):
        return value
    try:
        parsed = parse(value)
    except PydanticCustomError:
        return None
    return parsed if isinstance(parsed, timedelta) else None


class StateRetention(SpecModel):
    """How long state is kept: warm snapshots per agent, and hot deltas without a warm merge."""

    warm_snapshots: int = Field(
        default=3, ge=1, le=100, description="Warm snapshots kept per agent (1-100)"
    )
    hot: Duration = Field(
        default=timedelta(days=7),
        description="Hot deltas older than this are dropped even without a warm merge",
        examples=["7d"],
    )


Tier = Literal["hot", "warm", "cold"]


class State(SpecModel):
    """The state plane (docs/state.md): how often the agent's state is checkpointed, merged
    and verified, container tier overrides, retention, encryption, and restart on failure."""

    checkpoint_interval: CheckpointInterval = Field(
        default=timedelta(seconds=5),
        description="Automatic checkpoint period (hot tier), at least 100ms; 0 or off: "
        "explicit checkpoint() only",
        examples=["5s"],
    )
    warm_interval: StateInterval = Field(
        default=timedelta(minutes=5),
        description="Warm tier: captured and merged on the node's disk this often (at least "
        "checkpoint_interval)",
        examples=["5m"],
    )
    cold_interval: StateInterval = Field(
        default=timedelta(hours=1),
        description="Cold tier: re-verified in the object store this often",
        examples=["1h"],
    )
    tiers: dict[str, Tier] = Field(
        default_factory=dict,
        description=f"Container name -> hot, warm or cold (at most {MAX_STATE_TIERS}); others "
        "keep their kind's default",
        examples=[{"history": "hot", "adapter": "warm"}],
    )
    retention: StateRetention = StateRetention()
    max_size: ByteSize = Field(
        default=1 << 30,
        description="Most bytes of the agent's state a node keeps (its warm snapshot and the "
        "deltas after it); a checkpoint past it is refused (1MiB-1TiB)",
        examples=["2GiB"],
    )
    encryption: Annotated[Literal["tenant-key"], BeforeValidator(_encryption)] = Field(
        default="tenant-key", description="tenant-key: encrypted with the tenant's state key"
    )
    restart: Literal["on-failure", "never"] = Field(
        default="on-failure",
        description="on-failure: a sandbox that dies (signal, non-zero exit) starts again in "
        "place; never: its exit is final",
    )
    max_restarts: int = Field(
        default=5,
        ge=0,
        le=MAX_RESTARTS,
        description=f"Restarts before the exit is final (0-{MAX_RESTARTS})",
    )

    @field_validator("max_size")
    @classmethod
    def _bounded_size(cls, value: int) -> int:
        if not 1 << 20 <= int(value) <= 1 << 40:
            raise invalid(
                f"{int(value)} bytes is outside 1MiB-1TiB",
                "the most bytes of state one agent may keep on a node, e.g. 2GiB",
            )
        return value

    @field_validator("tiers", mode="before")
    @classmethod
    def _bounded_tiers(cls, value: Any) -> Any:
        """At most :data:`MAX_STATE_TIERS` entries, each named like a container (checked before
        the values: a hostile spec costs no work per entry beyond the bound)."""
        if not isinstance(value, dict):
            raise invalid(
                f"expected a mapping of container name to tier, got {type_name(value)}",
                "tiers: {history: hot, adapter: warm, base: cold}",
            )
        if len(value) > MAX_STATE_TIERS:
            raise invalid(
                f"{len(value)} tier overrides; at most {MAX_STATE_TIERS}",
                "name only the containers whose kind's default tier does not fit",
            )
        for name in value:
            if not isinstance(name, str) or not _CONTAINER_NAME.fullmatch(name):
                raise invalid(
                    f"{name!r} is not a container name", CONTAINER_NAME_HINT, loc=(str(name),)
                )
        return value

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        """warm_interval at least checkpoint_interval; retention.hot at least warm_interval
        (hot deltas must outlive the merge that makes them redundant)."""
        problems: list[PydanticCustomError] = []
        checkpoint = _raw_interval(
            fields.get("checkpoint_interval", timedelta(seconds=5)), _checkpoint_interval
        )
        warm = _raw_interval(fields.get("warm_interval", timedelta(minutes=5)), _state_interval)
        if checkpoint is None or warm is None:
            return problems
        if checkpoint > _OFF and warm < checkpoint:
            where = "warm_interval" if "warm_interval" in fields else "checkpoint_interval"
            problems.append(
                invalid(
                    f"warm_interval {format_duration(warm)} is shorter than checkpoint_interval "
                    f"{format_duration(checkpoint)}",
                    "warm state is captured by checkpoints: make warm_interval at least "
                    "checkpoint_interval (default 5m)",
                    (where,),
                )
            )
        retention = fields.get("retention")
        hot = _get(retention, "hot") if retention is not None else None
        hot_interval = _raw_interval(hot, parse_duration) if hot is not None else None
        if hot_interval is not None and hot_interval < warm:
            problems.append(
                invalid(
                    f"retention.hot {format_duration(hot_interval)} is shorter than "
                    f"warm_interval {format_duration(warm)}: hot deltas would be dropped before "
                    "a warm merge keeps them",
                    f"retention.hot of at least {format_duration(warm)} (default 7d)",
                    ("retention", "hot"),
                )
            )
        return problems


def _get(item: Any, *names: str) -> Any:
    """A field of a validated model or of the raw YAML mapping (first name that is set)."""
    for name in names:
        value = item.get(name) if isinstance(item, dict) else getattr(item, name, None)
        if value is not None:
            return value
    return None


def topology_problems(fields: Mapping[str, Any]) -> list[PydanticCustomError]:
    """Between-field problems of a task topology: on validated values or raw YAML alike."""
    problems: list[PydanticCustomError] = []
    tasks = fields.get("tasks") or ()
    if not isinstance(tasks, list | tuple):
        tasks = ()
    if tasks and fields.get("entrypoint") is not None:
        problems.append(
            invalid(
                "a spec with `tasks:` runs each task's own `script`; a top-level `entrypoint` "
                "would run nothing",
                "move the command into a task (script: python agent.py), or drop `tasks:` for "
                "a single sandbox",
                ("entrypoint",),
            )
        )
    if tasks and _get(fields.get("resources"), "gpu") is not None:
        problems.append(
            invalid(
                "with `tasks:`, GPUs are asked per task; resources.gpu would apply to none",
                "give each task compute_unit: {gpu_type: h100, gpus: 1}",
                ("resources", "gpu"),
            )
        )
    names: dict[str, int] = {}
    for index, task in enumerate(tasks):
        name = _get(task, "name")
        if not isinstance(name, str):
            continue
        if name in names:
            problems.append(
                invalid(
                    f"duplicate task {name!r} (also at tasks[{names[name]}])",
                    "each task name once",
                    ("tasks", index, "name"),
                )
            )
        else:
            names[name] = index
    problems += _edge_problems(fields.get("communication") or (), names)
    return problems


def _edge_problems(edges: Any, names: dict[str, int]) -> list[PydanticCustomError]:
    problems: list[PydanticCustomError] = []
    if not isinstance(edges, list | tuple):
        return problems
    known = (
        f"one of: {', '.join(names)}"
        if names
        else "no tasks are declared: list them under `tasks:`"
    )
    seen: dict[frozenset[str], int] = {}
    for index, edge in enumerate(edges):
        ends = []
        for field, attrs in (("from", ("src", "from")), ("to", ("to",))):
            value = _get(edge, *attrs)
            if not isinstance(value, str):
                continue
            if value not in names:
                problems.append(
                    invalid(
                        f"{value!r} is not a task",
                        known,
                        ("communication", index, field),
                    )
                )
            ends.append(value)
        if len(ends) != 2:
            continue
        if ends[0] == ends[1]:
            problems.append(
                invalid(
                    f"an edge from {ends[0]!r} to itself",
                    "link two different tasks (a unit reaches itself without one)",
                    ("communication", index, "to"),
                )
            )
            continue
        pair = frozenset(ends)
        if pair in seen:
            problems.append(
                invalid(
                    f"duplicate edge between {ends[0]!r} and {ends[1]!r} (also at "
                    f"communication[{seen[pair]}]); an edge carries both directions",
                    "one edge per pair of tasks",
                    ("communication", index),
                )
            )
        else:
            seen[pair] = index
    return problems


# -- the spec ------------------------------------------------------------------------------------


# -- record and replay (docs/experiments.md) ------------------------------------------------------

MAX_RECORDED_HOSTS = 32
RECORDING_ID = re.compile(r"rec_[0-9a-f]{32}")
RECORDING_ID_HINT = "a recording id such as rec_3f2a... (32 hex digits), from `recording.saved`"


def _recording_id(value: str) -> str:
    if not RECORDING_ID.fullmatch(value):
        raise invalid(f"{value!r} is not a recording id", RECORDING_ID_HINT)
    return value


class Record(SpecModel):
    """What the sandbox records (docs/experiments.md): its SDK tool calls, and the HTTP(S)
    requests to some hosts (through the node agent's TLS proxy); saved encrypted in the object
    store when it ends, announced by ``recording.saved``."""

    tools: bool = Field(
        default=True, description="Record every tool call made through dsec_sdk (call_tool)"
    )
    http: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_RECORDED_HOSTS,
        description="Hosts whose HTTP requests are recorded; each needs an egress rule with "
        "`tls_proxy: true` (the proxy sees the requests)",
        examples=[["api.openai.com"]],
    )

    @field_validator("http")
    @classmethod
    def _hosts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(normalize_domain(host) for host in value)


def record_problems(fields: Mapping[str, Any]) -> list[PydanticCustomError]:
    """``record`` and ``replay`` exclude each other; every recorded host is proxied."""
    record, replay = fields.get("record"), fields.get("replay")
    problems: list[PydanticCustomError] = []
    if record is not None and replay is not None:
        problems.append(
            invalid(
                "`record` and `replay` exclude each other: a replaying sandbox's answers are "
                "the recording",
                "remove one of them",
                ("replay",),
            )
        )
    source = record if record is not None else None
    hosts = _field(source, "http") or ()
    if not hosts:
        return problems
    policy = fields.get("security_policy")
    network = _field(policy, "network")
    proxied = {
        _field(rule, "domain")
        for rule in (_field(network, "egress") or ())
        if _field(rule, "tls_proxy") is True
    }
    for index, host in enumerate(hosts):
        if isinstance(host, str) and host.lower().rstrip(".") not in proxied:
            problems.append(
                invalid(
                    f"host {host!r} is recorded but not reached through the TLS proxy",
                    f"an egress rule `domain: {host}` with `tls_proxy: true` (and a requests "
                    "rate limit)",
                    ("record", "http", index),
                )
            )
    return problems


# -- tools (issue 16: retries, breaker, fallbacks per tool; docs/tools.md) -------------------------

MAX_TOOLS = 64
_TOOL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,62}")
TOOL_NAME_HINT = "1-63 of [A-Za-z0-9_-], starting with a letter, e.g. web_search"
RetryableClass = Literal["timeout", "rate_limited", "upstream_5xx", "unavailable"]
RETRYABLE_CLASSES: tuple[RetryableClass, ...] = (
    "timeout",
    "rate_limited",
    "upstream_5xx",
    "unavailable",
)
_MAX_TOOL_TIME_S = 3600.0


def _tool_name(value: str) -> str:
    if not isinstance(value, str) or not _TOOL_NAME.fullmatch(value):
        raise invalid(f"{value!r} is not a tool name", TOOL_NAME_HINT)
    return value


ToolName = Annotated[str, AfterValidator(_tool_name)]


def _at_most_an_hour(value: timedelta) -> timedelta:
    if value.total_seconds() > _MAX_TOOL_TIME_S:
        raise invalid(
            f"{format_duration(value)} is longer than a tool call may wait",
            "at most 1h, e.g. 30s",
        )
    return value


ToolDuration = Annotated[Duration, AfterValidator(_at_most_an_hour)]


class ToolRetries(SpecModel):
    """Retries of one tool: exponential backoff with full jitter, bounded by attempts and time.
    ``bad_arguments`` and ``network_policy`` failures are never retried."""

    attempts: int = Field(default=3, ge=1, le=10, description="Attempts in all (1: no retry)")
    max_time: ToolDuration = Field(
        default=timedelta(seconds=30), description="No wait is taken that would end past this"
    )
    backoff: ToolDuration = Field(
        default=timedelta(seconds=0.2), description="First wait's ceiling (then doubled)"
    )
    max_backoff: ToolDuration = Field(
        default=timedelta(seconds=5), description="Ceiling of any one wait"
    )
    on: tuple[RetryableClass, ...] = Field(
        default=RETRYABLE_CLASSES, description="Failure classes retried"
    )


class ToolBreaker(SpecModel):
    """The tool's circuit breaker."""

    failures: int = Field(default=5, ge=1, le=1000, description="Failures in a row that open it")
    reset_after: ToolDuration = Field(
        default=timedelta(seconds=30), description="Open this long, then one trial call"
    )


class ToolPolicySpec(SpecModel):
    """What the SDK's tool pipeline does for one tool (``tools.<name>``)."""

    timeout: ToolDuration | None = Field(default=None, description="Per attempt; unset: none")
    retries: ToolRetries = ToolRetries()
    breaker: ToolBreaker = ToolBreaker()
    fallback: tuple[ToolName, ...] = Field(
        default=(), max_length=8, description="Tools tried in order when this one fails"
    )
    degraded_after: int = Field(
        default=3, ge=1, le=1000, description="Failed calls in a row before tool.degraded"
    )
    secret: str | None = Field(
        default=None,
        description="The env var (from runtime_context) holding its key: named in the diagnosis "
        "of auth failures",
        examples=["WEB_SEARCH_KEY"],
    )
    hosts: tuple[str, ...] = Field(
        default=(), max_length=16, description="Hosts it calls (plain HTTP calls count for it)"
    )
    family: str | None = Field(
        default=None, max_length=63, description="Dashboard row; unset: the catalogue's category"
    )

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for index, host in enumerate(value):
            if not _HOSTNAME.fullmatch(host.lower()):
                raise invalid(
                    f"{host!r} is not a host name", "e.g. api.websearch.com", loc=(index,)
                )
        return tuple(h.lower() for h in value)

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        retries = fields.get("retries")
        problems: list[PydanticCustomError] = []
        if isinstance(retries, ToolRetries) and retries.backoff > retries.max_backoff:
            problems.append(
                invalid(
                    f"backoff {format_duration(retries.backoff)} is above max_backoff "
                    f"{format_duration(retries.max_backoff)}",
                    "backoff is the first wait's ceiling; max_backoff caps every wait",
                    loc=("retries", "backoff"),
                )
            )
        return problems


def _field(value: Any, name: str) -> Any:
    """A field of a validated model or of its raw YAML mapping (the loader's second pass)."""
    if isinstance(value, Mapping):
        return value.get(name)
    return getattr(value, name, None)


def _names(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list | tuple) else []


def tools_problems(fields: Mapping[str, Any]) -> list[PydanticCustomError]:
    """The ``tools:`` section against the rest of the spec: no tool falls back to itself or
    round in a circle, and ``secret`` names a secret the runtime context injects. Runs on the
    validated models and, when something else failed, on the raw YAML (every error at once)."""
    tools = fields.get("tools")
    if not isinstance(tools, Mapping):
        return []
    problems: list[PydanticCustomError] = []
    context = fields.get("runtime_context")
    env_vars = _field(context, "env_vars") if context is not None else ()
    secrets = {
        _field(e, "name") for e in env_vars or () if _field(e, "source") and _field(e, "name")
    }
    fallbacks = {name: _names(_field(policy, "fallback")) for name, policy in tools.items()}
    for name, policy in tools.items():
        if not isinstance(policy, Mapping | ToolPolicySpec):
            continue
        for index, other in enumerate(fallbacks[name]):
            if other == name:
                problems.append(
                    invalid(
                        f"tool {name!r} falls back to itself",
                        "name another tool (e.g. local_search), or remove it",
                        loc=("tools", name, "fallback", index),
                    )
                )
                continue
            seen, path = {name}, [name, other]
            chain = fallbacks.get(other) or []
            while chain:
                nxt = chain[0]
                if nxt in seen or nxt == path[-1]:
                    problems.append(
                        invalid(
                            f"fallbacks go round in a circle: {' → '.join([*path, nxt])}",
                            "a fallback chain must end at a tool with no fallback",
                            loc=("tools", name, "fallback", index),
                        )
                    )
                    break
                seen.add(path[-1])
                path.append(nxt)
                chain = fallbacks.get(nxt) or []
        secret = _field(policy, "secret")
        if isinstance(secret, str) and context is not None and secret not in secrets:
            known = ", ".join(sorted(str(x) for x in secrets)) or "none"
            problems.append(
                invalid(
                    f"secret {secret!r} is not a secret of runtime_context.env_vars",
                    f"name an env var with a source (secrets here: {known})",
                    loc=("tools", name, "secret"),
                )
            )
    return problems


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
    workdir: WorkDir = Field(default="/workspace", description="Where the code bundle lands")
    dependencies: tuple[Dependency, ...] = ()
    build_options: tuple[NonEmptyStr, ...] = ()
    resources: Resources = Resources()
    timeout: Duration | None = Field(default=None, description="Wall-clock limit; unset: none")
    runtime_context: RuntimeContext = RuntimeContext()
    security_policy: SecurityPolicy = SecurityPolicy()
    include_code: IncludeCode = IncludeCode()
    tasks: tuple[Task, ...] = Field(
        default=(),
        description=f"Compute units of a task topology (at most {MAX_TASKS}); unset: one unit, "
        "`main`",
    )
    communication: tuple[Link, ...] = Field(
        default=(),
        description=f"Edges between tasks: from, to, protocol (at most {MAX_LINKS})",
    )
    migration: Migration = Migration()
    scheduling: Scheduling = Scheduling()
    state: State | None = Field(
        default=None,
        description="The state plane (docs/state.md): checkpoints, tiers, retention, "
        "encryption, restart on failure; unset: the sandbox keeps no state",
    )
    record: Record | None = Field(
        default=None,
        description="Record the sandbox's tool calls and HTTP requests (docs/experiments.md); "
        "unset: nothing is recorded",
    )
    replay: Annotated[str, AfterValidator(_recording_id)] | None = Field(
        default=None,
        description="Answer every recorded call from this recording, byte for byte; a call "
        "it does not hold fails (never made live)",
        examples=["rec_0123456789abcdef0123456789abcdef"],
    )
    tools: dict[ToolName, ToolPolicySpec] = Field(
        default_factory=dict,
        description=f"Per tool (at most {MAX_TOOLS}): timeout, retries, breaker, fallback, "
        "degraded_after (docs/tools.md); unset: the catalogue's defaults",
    )

    @classmethod
    def cross_checks(cls, fields: Mapping[str, Any]) -> list[PydanticCustomError]:
        """Task names unique; edges between declared tasks, once; tasks own the commands and
        the GPUs; record and replay agree with the egress rules; tool fallbacks end and name
        declared secrets."""
        return [*topology_problems(fields), *record_problems(fields), *tools_problems(fields)]

    @field_validator("tools", mode="before")
    @classmethod
    def _bounded_tools(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and len(value) > MAX_TOOLS:
            raise invalid(
                f"{len(value)} tools; a spec declares at most {MAX_TOOLS}",
                "declare only the tools whose policy differs from the defaults",
            )
        return value

    @model_validator(mode="after")
    def _links_fit(self) -> SandboxSpec:
        self.unit_needs()
        return self

    def unit_needs(self) -> dict[str, GpuNeeds]:
        """Each task's resolved GPU needs, narrowed to NVLink models where an nvlink-p2p edge
        ends (a single-sandbox spec: no entries).

        Raises:
            PydanticCustomError: an nvlink-p2p edge ends at a unit that cannot have NVLink.
        """
        needs = {task.name: task.compute_unit.gpu_needs() for task in self.tasks}
        for index, edge in enumerate(self.communication):
            if edge.protocol != "nvlink-p2p":
                continue
            for field, name in (("from", edge.src), ("to", edge.to)):
                need = needs.get(name)
                if need is None:
                    continue
                needs[name] = _nvlink_end(need, name, ("communication", index, field))
        return needs

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

    @field_validator("tasks", "communication", mode="before")
    @classmethod
    def _bounded_topology(cls, value: Any, info: ValidationInfo) -> Any:
        """At most :data:`MAX_TASKS` tasks and :data:`MAX_LINKS` links (checked before each
        is validated: a hostile spec costs no work per item beyond the bound)."""
        bound = MAX_TASKS if info.field_name == "tasks" else MAX_LINKS
        if isinstance(value, list | tuple) and len(value) > bound:
            what = "tasks" if info.field_name == "tasks" else "links"
            raise invalid(
                f"{len(value)} {what}; a topology has at most {bound}",
                "split the work into several sandboxes, or group tasks that run together",
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


def _nvlink_end(need: GpuNeeds, name: str, loc: tuple[str | int, ...]) -> GpuNeeds:
    """An nvlink-p2p edge's end: a unit with GPUs that have NVLink (its models narrowed to
    those)."""
    linked_models = ", ".join(m.name for m in gpumodels.CATALOG if m.nvlink)
    if not need.any_gpu:
        raise invalid(
            f"nvlink-p2p needs GPUs at both ends; task {name!r} has none",
            f"give {name!r} a compute_unit with gpu_type, or use "
            "protocol: rdma-over-converged-ethernet or shm",
            loc,
        )
    if not need.models:
        return need
    linked = tuple(m for m in need.models if gpumodels.BY_NAME[m].nvlink)
    if not linked:
        raise invalid(
            f"nvlink-p2p needs NVLink; task {name!r} accepts only GPUs without it "
            f"({', '.join(need.models)})",
            f"protocol: rdma-over-converged-ethernet (or shm on one node), or a gpu_type "
            f"with NVLink: {linked_models}",
            loc,
        )
    return GpuNeeds(linked, need.gpus, need.gpu_milli, need.min_memory_bytes)


def model_field_names(model: type[BaseModel]) -> list[str]:
    """Field names of a spec model, in declaration order (for hints)."""
    return list(model.model_fields)


def describe(value: Any) -> str:
    """Short description of a YAML value for messages: type and, for scalars, the value."""
    if isinstance(value, dict | list):
        return type_name(value)
    text = repr(value)
    return f"{type_name(value)} {text if len(text) <= 40 else text[:37] + '...'}"
