"""The policy service: validates sandbox specs, compiles enforcement plans, infers policy from code.

The decision is pure (:func:`validate`); ``handlers`` wire it to ``spec.submitted``.
"""

from dsec_policy.domain import ValidationOutcome, infer, validate
from dsec_policy.guardrails import OrgPolicy, check_guardrails, default_org_policy, parse_org_policy
from dsec_policy.infer.catalogue import Catalogue, ToolSemantics, load_catalogue
from dsec_policy.infer.needs import InferredNeeds
from dsec_policy.infer.render import render_policy_yaml

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
