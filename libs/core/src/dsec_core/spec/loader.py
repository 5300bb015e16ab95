"""Load a spec file: YAML -> migration -> validation, every problem located at its line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from dsec_core import gpumodels
from dsec_core.spec.errors import Severity, SpecError, sort_key
from dsec_core.spec.locate import cross_check_raw, errors_from_validation
from dsec_core.spec.migrate import migrate
from dsec_core.spec.models import (
    CURRENT_VERSION,
    DEFAULT_TASKS_BASE,
    SandboxSpec,
    accepted_models,
)
from dsec_core.spec.source import SourceMap, decode, parse_yaml
from dsec_core.spec.units import format_size, type_name

M = TypeVar("M", bound=BaseModel)

_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE)", re.IGNORECASE)


@dataclass(frozen=True)
class SpecResult:
    """The outcome of loading a spec: the spec (when valid), errors, warnings, and positions.

    ``source`` locates any field path in the file, so later checks (org guardrails, comparison
    with the agent's code) can report at the user's line too.
    """

    spec: SandboxSpec | None
    errors: tuple[SpecError, ...]
    warnings: tuple[SpecError, ...]
    source: SourceMap

    @property
    def ok(self) -> bool:
        """True when the spec is valid (warnings allowed)."""
        return self.spec is not None and not self.errors


@dataclass(frozen=True)
class DocumentResult(Generic[M]):
    """A YAML document validated against any model (spec, org policy)."""

    value: M | None
    errors: tuple[SpecError, ...]
    source: SourceMap


def load_document(text: str | bytes, filename: str, model: type[M]) -> DocumentResult[M]:
    """Parse YAML and validate it against ``model`` with located errors (no migration)."""
    data, smap, errors = _parse(text, filename)
    if errors:
        return DocumentResult(None, tuple(errors), smap)
    value, errors = _validate(data, smap, model)
    return DocumentResult(value, tuple(sorted(errors, key=sort_key)), smap)


def load_spec(text: str | bytes, filename: str = "dsec.yaml") -> SpecResult:
    """Load a sandbox spec, reporting every problem at once.

    Args:
        text: The YAML, as text or UTF-8 bytes.
        filename: Name used in every diagnostic (``FILE:LINE:COL``).

    Returns:
        A :class:`SpecResult`; ``spec`` is set only when there are no errors.
    """
    data, smap, errors = _parse(text, filename)
    warnings: list[SpecError] = []
    if not errors and not isinstance(data, dict):
        errors.append(
            smap.error(
                (),
                f"the spec must be a mapping of fields, got {type_name(data)}",
                hint='start with:\nversion: "1.2"\nname: my-agent\nbase: dsec/python311:latest',
                rule_id="not-a-mapping",
            )
        )
    if errors:
        return SpecResult(None, tuple(errors), (), smap)
    assert isinstance(data, dict)
    warnings += _topology_defaults(data, smap, filename)
    errors, migrated = migrate(data, smap)
    warnings += migrated
    spec, invalid = _validate(data, smap, SandboxSpec)
    errors += invalid
    if spec is not None:
        warnings += _lint(spec, smap)
    ok_spec = spec if not errors else None
    return SpecResult(
        ok_spec, tuple(sorted(errors, key=sort_key)), tuple(sorted(warnings, key=sort_key)), smap
    )


def _parse(text: str | bytes, filename: str) -> tuple[Any, SourceMap, list[SpecError]]:
    if isinstance(text, bytes):
        decoded, error = decode(text, filename)
        if error is not None or decoded is None:
            return None, SourceMap(filename), [error] if error else []
        text = decoded
    return parse_yaml(text, filename)


def _validate(data: Any, smap: SourceMap, model: type[M]) -> tuple[M | None, list[SpecError]]:
    try:
        return model.model_validate(data), []
    except ValidationError as exc:
        errors = errors_from_validation(exc, data, smap, model)
    seen = {(e.path, e.message) for e in errors}
    errors += [e for e in cross_check_raw(data, smap, model) if (e.path, e.message) not in seen]
    return None, errors


_GENERIC_STEMS = {"dsec", "spec", "sandbox"}


def default_name(filename: str) -> str | None:
    """The name a task topology without ``name:`` gets: the file's stem, or for a generic
    file name (``dsec.yaml``) its folder's name, made a DNS label; ``None`` if neither is one."""
    path = PurePosixPath(filename.replace("\\", "/"))
    stem = path.stem
    if stem.lower() in _GENERIC_STEMS and path.parent.name not in ("", ".", ".."):
        stem = path.parent.name
    name = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")[:63].strip("-")
    return name or None


def _topology_defaults(data: dict[str, Any], smap: SourceMap, filename: str) -> list[SpecError]:
    """A document with ``tasks:`` may leave out version, name and base (defaults: the current
    version and the file's name, each with a warning; ``dsec/python311:latest``)."""
    if "tasks" not in data:
        return []
    warnings = []
    if "version" not in data:
        data["version"] = CURRENT_VERSION
        warnings.append(
            smap.error(
                ("version",),
                f"no version; read as spec {CURRENT_VERSION}",
                hint=f'version: "{CURRENT_VERSION}"',
                severity=Severity.WARNING,
                rule_id="version",
            )
        )
    name = default_name(filename)
    if "name" not in data and name is not None:
        data["name"] = name
        warnings.append(
            smap.error(
                ("name",),
                f"no name; named {name!r} after the file",
                hint=f"name: {name}",
                severity=Severity.WARNING,
                rule_id="default-name",
            )
        )
    data.setdefault("base", DEFAULT_TASKS_BASE)
    return warnings


def _lint(spec: SandboxSpec, smap: SourceMap) -> list[SpecError]:
    """Warnings about valid but risky choices."""
    out: list[SpecError] = _gpu_lint(spec, smap) + _link_lint(spec, smap)
    for index, env in enumerate(spec.runtime_context.env_vars):
        if env.value is not None and _SECRET_NAME.search(env.name):
            out.append(
                smap.error(
                    ("runtime_context", "env_vars", index, "value"),
                    f"{env.name} looks like a secret but is given as a plain value; it will be "
                    "stored in the spec, the bundle and the event log",
                    hint="source: vault://MOUNT/PATH#KEY with ttl: 1h",
                    severity=Severity.WARNING,
                    rule_id="plain-secret",
                )
            )
    return out


def _link_lint(spec: SandboxSpec, smap: SourceMap) -> list[SpecError]:
    """An ``nvlink-p2p`` edge between tasks that accept no GPU model in common: NVLink joins
    GPUs of one model, so no node can give the two one NVLink domain; the scheduler places the
    edge as a network link (degraded), which the warning says."""
    out: list[SpecError] = []
    needs = spec.unit_needs()
    for index, edge in enumerate(spec.communication):
        if edge.protocol != "nvlink-p2p":
            continue
        a, b = needs.get(edge.src), needs.get(edge.to)
        if a is None or b is None or not a.models or not b.models:
            continue
        if set(a.models) & set(b.models):
            continue
        out.append(
            smap.error(
                ("communication", index, "protocol"),
                f"{edge.src} ({', '.join(a.models)}) and {edge.to} ({', '.join(b.models)}) "
                "cannot share an NVLink domain (NVLink joins GPUs of one model): the "
                "scheduler places this edge as a network link (degraded from nvlink-p2p)",
                hint="accept a common GPU model in both tasks for NVLink, or say "
                "protocol: rdma-over-converged-ethernet",
                severity=Severity.WARNING,
                rule_id="nvlink-degraded",
            )
        )
    return out


def _gpu_lint(spec: SandboxSpec, smap: SourceMap) -> list[SpecError]:
    """``resources.gpu`` of a single sandbox: a model the catalogue does not know, or more
    memory than the model has, can be placed nowhere (warnings: such specs were valid before
    the catalogue)."""
    gpu = spec.resources.gpu
    if gpu is None or gpu.type is None:
        return []
    models = accepted_models((gpu.type,))
    if not models:
        return [
            smap.error(
                ("resources", "gpu", "type"),
                f"unknown GPU model {gpu.type!r}: no node will match it",
                hint=f"known: {', '.join(gpumodels.known_names())}",
                severity=Severity.WARNING,
                rule_id="unknown-gpu-model",
            )
        ]
    if gpu.memory and all(0 < m.memory_bytes < gpu.memory for m in models):
        have = ", ".join(f"{m.name} {format_size(m.memory_bytes)}" for m in models)
        return [
            smap.error(
                ("resources", "gpu", "memory"),
                f"no {gpu.type} has {format_size(gpu.memory)} ({have}): no node will match it",
                hint=f"memory: {format_size(max(m.memory_bytes for m in models))} or less",
                severity=Severity.WARNING,
                rule_id="impossible-gpu",
            )
        ]
    return []
