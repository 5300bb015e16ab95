"""The policy service's decision, as a pure function: spec text (+ code) -> plan or errors.

No I/O here: the caller passes the spec text, the code bundle as a mapping of relative paths to
bytes, and the parsed org policy. The same function backs ``dsec spec check`` and the service's
``spec.submitted`` handler, so users see locally exactly what the service will say.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dsec_core.spec import (
    EnforcementPlan,
    Severity,
    SpecError,
    compile_plan,
    load_spec,
)
from dsec_core.spec.errors import sort_key
from pydantic import BaseModel, ConfigDict

from dsec_rules.compare import compare
from dsec_rules.guardrails import OrgPolicy, StackFacts, check_guardrails, default_org_policy
from dsec_rules.infer.analyzer import analyze_files
from dsec_rules.infer.catalogue import Catalogue, load_catalogue
from dsec_rules.infer.needs import InferredNeeds, infer_needs
from dsec_rules.scope import check_scope

_FIXED = ("tenant.", "system.")
_TENANT = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")


def _bad_tenant(filename: str, tenant: str) -> SpecError:
    return SpecError.whole_file(
        filename,
        f"the submitter's tenant {tenant[:64]!r} is not a valid tenant name",
        "tenant.invalid",
        "a DNS label: lowercase letters, digits and '-', e.g. acme",
    )


class ValidationOutcome(BaseModel):
    """What validating a spec decided: a plan (when accepted), errors, warnings, code needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: EnforcementPlan | None
    errors: tuple[SpecError, ...]
    warnings: tuple[SpecError, ...]
    needs: InferredNeeds | None = None

    @property
    def ok(self) -> bool:
        """True when the spec is accepted (``spec.validated``), False for ``spec.rejected``."""
        return self.plan is not None and not self.errors


def infer(code_files: Mapping[str, bytes], catalogue: Catalogue | None = None) -> InferredNeeds:
    """What a code bundle needs, from static analysis and the tool catalogue (pure)."""
    catalogue = catalogue or load_catalogue()
    return infer_needs(analyze_files(code_files, catalogue.class_names()), catalogue)


def validate(
    text: str | bytes,
    filename: str = "dsec.yaml",
    code_files: Mapping[str, bytes] | None = None,
    org_policy: OrgPolicy | None = None,
    catalogue: Catalogue | None = None,
    *,
    tenant: str = "default",
    facts: StackFacts | None = None,
) -> ValidationOutcome:
    """Validate a spec against the schema, the org guardrails and (optionally) its code.

    Args:
        text: The spec YAML.
        filename: Name used in diagnostics.
        code_files: The code bundle (relative path -> bytes); ``None`` skips the comparison.
        org_policy: Guardrails; ``None`` means the packaged baseline.
        catalogue: Tool semantics; ``None`` means the packaged catalogue.
        tenant: The submitter's tenant (from its signed identity, never from the YAML).
        facts: The stack's system bucket, endpoints and directories (defaults: bucket ``dsec``).

    Returns:
        The outcome: ``plan`` is set only when there is no error-level diagnostic.
    """
    if not _TENANT.fullmatch(tenant):
        return ValidationOutcome(plan=None, errors=(_bad_tenant(filename, tenant),), warnings=())
    loaded = load_spec(text, filename)
    needs = infer(code_files, catalogue) if code_files is not None else None
    diagnostics = [*loaded.errors, *loaded.warnings]
    plan = None
    policy = org_policy if org_policy is not None else default_org_policy()
    if loaded.spec is not None:
        spec = loaded.spec
        facts = facts or StackFacts()
        scope = policy.scope(tenant)
        plan = compile_plan(spec, tenant, loaded.source, filename).model_copy(
            update={"tenant_vault": scope.vault}
        )
        diagnostics += check_guardrails(spec, policy, loaded.source, facts)
        diagnostics += check_scope(spec, plan, tenant, scope, facts, loaded.source)
        if needs is not None:
            diagnostics += compare(spec, plan, needs, loaded.source)
    if needs is not None:
        diagnostics += _parse_failures(needs)
    diagnostics = [_with_severity(d, policy) for d in diagnostics]
    errors = sorted((d for d in diagnostics if d.severity is Severity.ERROR), key=sort_key)
    warnings = sorted((d for d in diagnostics if d.severity is not Severity.ERROR), key=sort_key)
    return ValidationOutcome(
        plan=plan if not errors else None,
        errors=tuple(errors),
        warnings=tuple(warnings),
        needs=needs,
    )


def _with_severity(diagnostic: SpecError, policy: OrgPolicy) -> SpecError:
    """Apply the org policy's ``severities`` override for the diagnostic's rule id (``tenant.*``
    and ``system.*`` refusals can be raised, never lowered)."""
    wanted = policy.severities.get(diagnostic.rule_id or "")
    if wanted is None or wanted is diagnostic.severity:
        return diagnostic
    if diagnostic.rule_id.startswith(_FIXED) and diagnostic.severity is Severity.ERROR:
        return diagnostic
    return diagnostic.model_copy(update={"severity": wanted})


def _parse_failures(needs: InferredNeeds) -> list[SpecError]:
    return [
        SpecError(
            file=failure.file,
            line=failure.line,
            column=failure.column,
            path="",
            message=f"cannot analyze this file: {failure.message}",
            hint="fix the syntax error; its needs were not checked",
            severity=Severity.WARNING,
            rule_id="infer.parse-error",
        )
        for failure in needs.parse_failures
    ]
