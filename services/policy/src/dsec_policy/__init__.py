"""The policy service: validates sandbox specs, compiles enforcement plans, infers policy from code.

The decision is pure and lives in the ``dsec_rules`` library (shared with ``dsec spec check`` and
``dsec policy infer``); ``handlers`` wire it to ``spec.submitted``.
"""

from dsec_rules import (
    Catalogue,
    InferredNeeds,
    OrgPolicy,
    ToolSemantics,
    ValidationOutcome,
    check_guardrails,
    default_org_policy,
    infer,
    load_catalogue,
    parse_org_policy,
    render_policy_yaml,
    validate,
)

__all__ = [
    "Catalogue",
    "InferredNeeds",
    "OrgPolicy",
    "ToolSemantics",
    "ValidationOutcome",
    "check_guardrails",
    "default_org_policy",
    "infer",
    "load_catalogue",
    "parse_org_policy",
    "render_policy_yaml",
    "validate",
]
