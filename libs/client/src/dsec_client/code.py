"""A spec as text, and its code directory as a content-addressed bundle in the object store
(what ``dsec submit --code DIR`` does)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import yaml
from dsec_core.codebundle import BundleError, build_bundle, bundle_key, declared_max_size
from dsec_core.events import BundleRef
from dsec_core.settings import Settings

from dsec_client.errors import InvalidInput, Unreachable

SpecLike = str | os.PathLike[str] | dict[str, Any]
"""A spec: a path to its YAML file, the YAML text itself, or the spec as a dict."""


def submitted_name(spec: Path) -> str:
    """The name the services see the spec by: ``dsec.yaml`` goes with its folder
    (``rag-training/dsec.yaml``), so a spec without ``name:`` is named after the folder by the
    policy service exactly as ``dsec spec check`` names it."""
    parent = spec.resolve().parent.name
    return f"{parent}/{spec.name}" if parent else spec.name


def spec_text(spec: SpecLike) -> tuple[str, str]:
    """``(yaml_text, filename)`` of a spec given as a path, YAML text or dict.

    A ``str`` is a path when it is one line that names a file, or ends in ``.yaml`` / ``.yml``
    and holds no ``": "``; any other ``str`` is the YAML text (named ``spec.yaml``).

    Raises:
        InvalidInput: the file cannot be read, or the dict is not YAML-serialisable.
    """
    if isinstance(spec, dict):
        try:
            return yaml.safe_dump(spec, sort_keys=False), "spec.yaml"
        except yaml.YAMLError as exc:
            raise InvalidInput(f"the spec dict is not YAML: {exc}") from None
    if isinstance(spec, str) and not _names_a_file(spec):
        return spec, "spec.yaml"
    path = Path(spec)
    try:
        return path.read_text(), submitted_name(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read spec {path}: {exc}") from None


def _names_a_file(text: str) -> bool:
    if "\n" in text:
        return False
    return os.path.isfile(text) or (text.endswith((".yaml", ".yml")) and ": " not in text)


def _include_code(text: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
        include = data.get("include_code", {})
        return include if isinstance(include, dict) else {}
    except (yaml.YAMLError, AttributeError):
        return {}


def exclude_patterns(text: str) -> list[str]:
    """The spec's ``include_code.exclude_patterns`` if readable (validation is the service's)."""
    patterns = _include_code(text).get("exclude_patterns", [])
    return [str(p) for p in patterns] if isinstance(patterns, list) else []


def upload_code(
    code: Path,
    text: str,
    settings: Settings,
    skipped: list[str] | None = None,
    *,
    tenant: str,
) -> BundleRef:
    """Bundle ``code`` (with the spec's exclude patterns and size bound) and store it
    content-addressed under ``tenant`` (the submitter's); ``skipped`` receives the special
    files left out (not code). Blocking (disk and S3): call it from a thread in async code.

    Raises:
        InvalidInput: ``code`` is not a directory, or cannot be bundled (too big, unreadable).
        Unreachable: no object store configured, or it cannot be written.
    """
    import urllib3
    from dsec_core import objectstore
    from minio.error import S3Error

    if not code.is_dir():
        raise InvalidInput(f"{code} is not a directory")
    try:
        bundle = build_bundle(code, exclude_patterns(text), max_size=declared_max_size(text))
    except (BundleError, OSError) as exc:
        raise InvalidInput(f"{code}: {exc}") from None
    if skipped is not None:
        skipped.extend(bundle.skipped)
    try:
        client = objectstore.client(settings)
    except objectstore.ObjectStoreNotConfigured as exc:
        raise Unreachable(str(exc)) from None
    key = bundle_key(tenant, bundle.digest)
    data = bundle.read()
    try:
        objectstore.ensure_bucket(client, settings.s3_bucket)
        client.put_object(settings.s3_bucket, key, io.BytesIO(data), len(data))
    except (S3Error, urllib3.exceptions.HTTPError, OSError) as exc:
        raise Unreachable(
            f"cannot store the code bundle in the object store "
            f"({type(exc).__name__}); is the stack up? (`dsec status`)"
        ) from None
    return BundleRef(
        digest=bundle.digest,
        object_key=key,
        size=len(data),
        files=len(bundle.manifest.files),
        expanded_size=bundle.manifest.total_size,
    )
