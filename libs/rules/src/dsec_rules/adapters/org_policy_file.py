"""Load the org guardrails file named by ``DSEC_ORG_POLICY``."""

from __future__ import annotations

from pathlib import Path

from dsec_rules.guardrails import OrgPolicy, default_org_policy, parse_org_policy


class OrgPolicyError(ValueError):
    """The org policy file is unreadable or invalid; the message lists every located error."""


def load_org_policy(path: Path | None) -> OrgPolicy:
    """The org policy at ``path``, or the packaged baseline when ``path`` is ``None``.

    Raises:
        OrgPolicyError: the file cannot be read or does not validate.
    """
    if path is None:
        return default_org_policy()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise OrgPolicyError(f"{path}: cannot read org policy: {exc.strerror or exc}") from None
    result = parse_org_policy(data, str(path))
    if result.value is None:
        raise OrgPolicyError("\n".join(error.format() for error in result.errors))
    return result.value
