"""Wiring of the policy service: its handlers on the bus."""

from __future__ import annotations

from dsec_core.events import SpecRejected, SpecSubmitted, SpecValidated
from dsec_core.service import RetryPolicy, Service
from dsec_core.settings import Settings
from dsec_rules.adapters.org_policy_file import load_org_policy

from dsec_policy.handlers import PolicyHandlers
from dsec_policy.uploads import CodeUploads

VALIDATE_TIMEOUT_S = 120.0
"""The longest one validation may run: it reads the spec, the org policy and the bus (a
validation takes milliseconds; the rest is a margin for a loaded machine)."""


def create_service(settings: Settings | None = None) -> Service:
    """Build the policy service: ``spec.submitted`` → ``spec.validated | spec.rejected``, and
    the grants with which users store their code bundles (``dsec_rpc.upload.code``)."""
    service = Service("policy", settings)
    CodeUploads(service).attach()

    async def tenant_of(sandbox_id: str) -> str | None:
        # The gate exists once the service runs (before any handler is called).
        return None if service.gate is None else await service.gate.tenant_of(sandbox_id)

    handlers = PolicyHandlers(
        service.settings, load_org_policy(service.settings.org_policy), tenant_of=tenant_of
    )
    # Specs are independent requests: eight validations at once (FastStream ran a fetched batch
    # of 16 at once before, in stream order), the tenants taking turns, one tenant at most
    # seven; an attempt still running after VALIDATE_TIMEOUT_S is cancelled and retried.
    # Deliveries are verified and held (or ended, past their tenant's bound) 64 at a time, so
    # a neighbour's spec behind a tenant's burst is reached sooner.
    service.handles(
        SpecSubmitted,
        answers=(SpecValidated, SpecRejected),
        workers=8,
        batch=64,
        retry=RetryPolicy(attempt_timeout_s=VALIDATE_TIMEOUT_S),
    )(handlers.on_submitted)
    return service
