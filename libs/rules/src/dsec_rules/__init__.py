"""The rules of a sandbox spec, as pure code: validation, org guardrails, tenant scope, and the
policy inferred from an agent's code.

The policy service runs them on ``spec.submitted``; the CLI runs the same functions offline
(``dsec spec check``, ``dsec policy infer``). A library, not a service: both may import it.
"""

from dsec_rules.domain import ValidationOutcome, infer, validate
from dsec_rules.guardrails import OrgPolicy, check_guardrails, default_org_policy, parse_org_policy
from dsec_rules.infer.catalogue import Catalogue, ToolSemantics, load_catalogue
from dsec_rules.infer.needs import InferredNeeds
from dsec_rules.infer.render import render_policy_yaml

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
