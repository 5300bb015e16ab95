"""What the policy service knows about the stack it protects, from its settings."""

from __future__ import annotations

from dsec_core.settings import Settings
from dsec_core.stackinfo import stack_dirs, stack_endpoints

from dsec_rules.guardrails import StackFacts


def stack_facts(settings: Settings) -> StackFacts:
    """The system bucket, the stack's endpoints (settings + ``stack.json``) and directories."""
    return StackFacts(
        system_bucket=settings.s3_bucket,
        endpoints=stack_endpoints(settings),
        dirs=stack_dirs(settings),
    )
