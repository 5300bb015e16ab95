"""A spec as text, and its code directory as a content-addressed bundle in the object store
(what ``dsec submit --code DIR`` does)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from pathlib import Path
from typing import Any

import yaml
from dsec_core import codeupload
from dsec_core.codebundle import BundleError, build_bundle, declared_max_size
from dsec_core.events import BundleRef
from nacl.public import PrivateKey

from dsec_client.errors import InvalidInput, Refused, Unreachable
from dsec_client.remote import first_genuine

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


async def upload_code(
    code: Path,
    text: str,
    *,
    nc: Any,
    gate: Any,
    identity: tuple[Any, Any],
    skipped: list[str] | None = None,
) -> BundleRef:
    """Bundle ``code`` (with the spec's exclude patterns and size bound) and store it
    content-addressed under the tenant of ``identity`` (key and certificate): the policy
    service grants the upload of exactly this bundle (:mod:`dsec_core.codeupload`), so the
    client needs no object-store credentials. ``skipped`` receives the special files left out
    (not code).

    Raises:
        InvalidInput: ``code`` is not a directory, or cannot be bundled (too big, unreadable).
        Refused: the policy service refused the upload (an unknown or revoked key, ...).
        Unreachable: no policy service answered, or the object store refused or failed.
    """
    if not code.is_dir():
        raise InvalidInput(f"{code} is not a directory")
    try:
        bundle = await asyncio.to_thread(
            build_bundle, code, exclude_patterns(text), max_size=declared_max_size(text)
        )
        data = await asyncio.to_thread(bundle.read)
    except (BundleError, OSError) as exc:
        raise InvalidInput(f"{code}: {exc}") from None
    if skipped is not None:
        skipped.extend(bundle.skipped)
    granted = await _grant(nc, gate, identity, bundle.digest, len(data))
    await asyncio.to_thread(_post, granted, data)
    return BundleRef(
        digest=bundle.digest,
        object_key=granted.object_key,
        size=len(data),
        files=len(bundle.manifest.files),
        expanded_size=bundle.manifest.total_size,
    )


async def _grant(
    nc: Any, gate: Any, identity: tuple[Any, Any], digest: str, size: int
) -> codeupload.Grant:
    """Ask the policy service for a grant to store ``size`` bytes of bundle ``digest``. Anything
    on the inbox not signed by a certified policy key for this request (anyone who read the
    request may publish there) is skipped, not believed."""
    key, cert = identity
    if size > codeupload.MAX_BYTES:
        raise InvalidInput(f"the code bundle is {size} bytes, over {codeupload.MAX_BYTES}")
    client = PrivateKey.generate()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        request = codeupload.sign_request(
            key,
            tenant=cert.tenant,
            producer=cert.subject,
            key_id=cert.key_id,
            reply_to=inbox,
            client_key=bytes(client.public_key),
            digest=digest,
            size=size,
        )
        parsed = codeupload.parse_request(request)
        await nc.publish(codeupload.SUBJECT, request, reply=inbox)

        async def believe(data: bytes) -> codeupload.Grant | tuple[str, str]:
            answer = codeupload.parse_answer(data)
            signer = await gate.keys.certificate(answer.key_id)
            if isinstance(signer, str) or signer.role != "policy":
                raise codeupload.UploadError("an answer not signed by the policy service")
            return answer.check(bytes.fromhex(signer.public_key), parsed.id, parsed.hash, client)

        def unanswered(why: str) -> Exception:
            return Unreachable(
                f"no policy service answered the code-upload request within "
                f"{codeupload.ANSWER_S:.0f} s{why}; is the stack up? (`dsec status`)"
            )

        outcome = await first_genuine(
            sub, codeupload.ANSWER_S, believe, codeupload.UploadError, unanswered
        )
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    if isinstance(outcome, tuple):
        reason, detail = outcome
        raise Refused(f"the policy service refused to store the code: {reason}: {detail}", reason)
    return outcome


def _post(granted: codeupload.Grant, data: bytes) -> None:
    """Upload ``data`` with the grant's POST policy (blocking: call it from a thread)."""
    import urllib3

    fields: dict[str, Any] = {**granted.fields, "file": ("bundle.tar.zst", data)}
    try:
        response = urllib3.request(
            "POST", granted.url, fields=fields, timeout=urllib3.Timeout(connect=10, read=300),
            retries=False,
        )  # fmt: skip
    except urllib3.exceptions.HTTPError as exc:
        raise Unreachable(
            f"cannot store the code bundle at {granted.url} ({type(exc).__name__}); is the "
            "object store up, and DSEC_S3_PUBLIC_URL the address users reach it at? "
            "(`dsec status`)"
        ) from None
    if response.status not in (200, 201, 204):
        found = re.search(rb"<Code>([A-Za-z]{1,64})</Code>", response.data[:4096])
        code = found.group(1).decode() if found else f"HTTP {response.status}"
        raise Unreachable(f"the object store refused the code bundle: {code}")
