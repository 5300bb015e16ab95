"""Upgrade spec data written for versions 1.0 and 1.1 to 1.2, before validation.

What changed:

* 1.0 -> 1.1: egress ``host`` became ``domain``; egress ``port: N`` became ``ports: [N]``;
  filesystem ``read``/``write`` became ``read_allowed``/``write_allowed``.
* 1.1 -> 1.2: egress ``internal_only`` became ``allow_internal_only``; the top-level ``exclude``
  list moved to ``include_code.exclude_patterns``.

Every rewrite leaves a warning at the old key, so users learn the new spelling, and the source
map follows the moved values so later errors still point at the user's lines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsec_core.spec.errors import Severity, SpecError
from dsec_core.spec.models import CURRENT_VERSION
from dsec_core.spec.source import FieldPath, SourceMap

SUPPORTED_VERSIONS = ("1.0", "1.1", "1.2")
_VERSION_HINT = f'version: "{CURRENT_VERSION}" (supported: {", ".join(SUPPORTED_VERSIONS)})'


class _Migration:
    """Collects the diagnostics of one migration run."""

    def __init__(self, smap: SourceMap, version: str) -> None:
        self.smap = smap
        self.version = version
        self.errors: list[SpecError] = []
        self.warnings: list[SpecError] = []

    def rename(self, container: dict[str, Any], path: FieldPath, old: str, new: str) -> None:
        self.move(container, path, old, container, path, new)

    def move(
        self,
        src: dict[str, Any],
        src_path: FieldPath,
        old: str,
        dst: dict[str, Any],
        dst_path: FieldPath,
        new: str,
    ) -> None:
        if old not in src:
            return
        if new in dst:
            self.errors.append(
                self.smap.error(
                    (*src_path, old),
                    f"both {old!r} (spec {self.version}) and {new!r} are set",
                    hint=f"keep only {new!r}",
                    rule_id="migration-conflict",
                    at="key",
                )
            )
            return
        dst[new] = src.pop(old)
        self.smap.move((*src_path, old), (*dst_path, new))
        self._note(dst_path, old, new)

    def wrap_in_list(self, container: dict[str, Any], path: FieldPath, old: str, new: str) -> None:
        if old not in container or new in container:
            self.rename(container, path, old, new)
            return
        container[new] = [container.pop(old)]
        self.smap.move((*path, old), (*path, new, 0))
        self.smap.keys[(*path, new)] = self.smap.locate((*path, old), "key")
        self._note(path, old, new, f"{new}: [{container[new][0]}]")

    def _note(self, path: FieldPath, old: str, new: str, written: str | None = None) -> None:
        self.warnings.append(
            self.smap.error(
                (*path, new),
                f"{old!r} is the spec {self.version} spelling; migrated to {new!r}",
                hint=f"write `{written or new + ':'}`",
                severity=Severity.WARNING,
                rule_id="deprecated-field",
                at="key",
            )
        )


def _mapping(data: Any, *keys: str) -> dict[str, Any] | None:
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None


def _egress_rules(data: dict[str, Any]) -> list[tuple[FieldPath, dict[str, Any]]]:
    network = _mapping(data, "security_policy", "network")
    rules = network.get("egress") if network else None
    if not isinstance(rules, list):
        return []
    base: FieldPath = ("security_policy", "network", "egress")
    return [((*base, i), rule) for i, rule in enumerate(rules) if isinstance(rule, dict)]


def _v10_to_v11(data: dict[str, Any], run: _Migration) -> None:
    for path, rule in _egress_rules(data):
        run.rename(rule, path, "host", "domain")
        run.wrap_in_list(rule, path, "port", "ports")
    filesystem = _mapping(data, "security_policy", "filesystem")
    if filesystem is not None:
        fs_path: FieldPath = ("security_policy", "filesystem")
        run.rename(filesystem, fs_path, "read", "read_allowed")
        run.rename(filesystem, fs_path, "write", "write_allowed")


def _v11_to_v12(data: dict[str, Any], run: _Migration) -> None:
    for path, rule in _egress_rules(data):
        run.rename(rule, path, "internal_only", "allow_internal_only")
    include = data.get("include_code")
    if "exclude" in data and include is None:
        include = data["include_code"] = {}
        run.smap.keys[("include_code",)] = run.smap.locate(("exclude",), "key")
    if isinstance(include, dict):
        run.move(data, (), "exclude", include, ("include_code",), "exclude_patterns")


_STEPS: dict[str, Callable[[dict[str, Any], _Migration], None]] = {
    "1.0": _v10_to_v11,
    "1.1": _v11_to_v12,
}


def migrate(data: dict[str, Any], smap: SourceMap) -> tuple[list[SpecError], list[SpecError]]:
    """Rewrite ``data`` in place to version 1.2.

    Returns:
        ``(errors, warnings)``. An unknown version is an error; validation then goes on as 1.2 so
        the user still hears about everything else.
    """
    if "version" not in data:
        return [], []
    raw = data["version"]
    version = str(raw) if isinstance(raw, str | float) else None
    run = _Migration(smap, version or "?")
    if version not in SUPPORTED_VERSIONS:
        shown = repr(raw) if isinstance(raw, str) else str(raw)
        run.errors.append(
            smap.error(
                ("version",),
                f"unsupported spec version {shown}",
                hint=_VERSION_HINT,
                rule_id="version",
            )
        )
        data["version"] = CURRENT_VERSION
        return run.errors, run.warnings
    if isinstance(raw, float):
        run.warnings.append(
            smap.error(
                ("version",),
                "the version is a number; write it as a string",
                hint=f'version: "{version}"',
                severity=Severity.WARNING,
                rule_id="version",
            )
        )
    for step_from in ("1.0", "1.1"):
        if version <= step_from:
            run.version = step_from
            _STEPS[step_from](data, run)
    if version != CURRENT_VERSION:
        run.warnings.append(
            smap.error(
                ("version",),
                f"spec version {version} was migrated to {CURRENT_VERSION}",
                hint=_VERSION_HINT,
                severity=Severity.WARNING,
                rule_id="version",
            )
        )
    data["version"] = CURRENT_VERSION
    return run.errors, run.warnings
