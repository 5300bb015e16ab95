"""Bus handlers of the policy service: ``spec.submitted`` → ``spec.validated | spec.rejected``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import blake3
from dsec_core.codebundle import BUNDLE_PREFIX, archive_bound, bundle_of_tenant, declared_max_size
from dsec_core.envelope import Envelope
from dsec_core.events import Payload, SpecRejected, SpecSubmitted, SpecValidated
from dsec_core.objectstore import BundleAltered, ObjectMissing, scan_bundle
from dsec_core.settings import Settings
from dsec_core.spec import SpecError
from dsec_rules.adapters.code_files import CodeDirError, read_bundle_sources
from dsec_rules.adapters.stack_facts import stack_facts
from dsec_rules.domain import ValidationOutcome, validate
from dsec_rules.guardrails import OrgPolicy

from dsec_policy.budget import Budget, BudgetExceeded, run_budgeted

BUNDLE_SCANS = 2
"""Code bundles read at once by one instance (each holds at most 16 MiB of sources)."""
_SCANS = ThreadPoolExecutor(BUNDLE_SCANS, thread_name_prefix="dsec-bundle-scan")


def _bundle_error(filename: str, message: str) -> SpecError:
    hint = "resubmit with `dsec submit --code DIR`"
    return SpecError.whole_file(filename, message, "code-bundle", hint, path="code")


def _budget_error(filename: str, reason: str) -> SpecError:
    return SpecError.whole_file(
        filename,
        f"the policy service stopped validating this spec: {reason}",
        "policy.budget",
        "a spec is a few KiB of plain YAML; split huge code bundles or anchors",
    )


class PolicyHandlers:
    """Validates submitted specs against the schema, the org guardrails and the agent code.

    Each validation runs in a child process with a time and memory ``budget``; a runaway ends in
    ``spec.rejected`` (rule ``policy.budget``) and costs the service nothing.
    """

    def __init__(
        self,
        settings: Settings,
        org_policy: OrgPolicy | None,
        budget: Budget | None = None,
        tenant_of: Callable[[str], Awaitable[str | None]] | None = None,
    ) -> None:
        self.settings = settings
        self.org_policy = org_policy
        self.budget = budget or Budget()
        self.facts = stack_facts(settings)
        # The tenant of a sandbox (its first authentic spec.submitted): the service's Gate.
        self.tenant_of = tenant_of
        self._scanning: dict[str, asyncio.Semaphore] = {}

    async def _scan_in_turn(
        self, tenant: str, scan: Callable[[], dict[str, bytes]]
    ) -> dict[str, bytes]:
        """Run ``scan`` in the scan pool, one scan of a tenant at a time: one tenant's
        bundles never hold both of the pool's threads. The tenant's turn ends when its scan's
        thread does, not when the attempt waiting for it is cancelled (the thread runs on)."""
        turn = self._scanning.setdefault(tenant, asyncio.Semaphore(1))
        await turn.acquire()
        loop = asyncio.get_running_loop()
        try:
            running = _SCANS.submit(scan)
        except BaseException:
            turn.release()
            raise

        def give_back(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed while the scan ran
                loop.call_soon_threadsafe(turn.release)

        running.add_done_callback(give_back)
        sources: dict[str, bytes] = await asyncio.wrap_future(running)
        return sources

    async def _handover_error(self, event: SpecSubmitted, tenant: str) -> SpecError | None:
        """``handover_from`` must name a sandbox of the submitter's own tenant (another
        tenant's sandbox reads as no sandbox at all: its existence is not disclosed)."""
        old = event.handover_from
        if old is None:
            return None
        owner = await self.tenant_of(old) if self.tenant_of is not None else None
        if owner == tenant:
            return None
        return SpecError.whole_file(
            event.filename,
            f"handover_from: no sandbox {old!r} of tenant {tenant!r} to hand over from",
            "handover.tenant",
            "`dsec sandbox upgrade ID` takes the id of one of your own running sandboxes "
            "(`dsec sandbox list`)",
            path="handover_from",
        )

    async def _code_files(self, event: SpecSubmitted, tenant: str) -> dict[str, bytes] | SpecError:
        if event.code is None:
            return {}
        key = event.code.object_key
        if not bundle_of_tenant(key, tenant):
            # a bundle reference is not a secret (it is on the bus): before, one copied from
            # another tenant's spec ran that tenant's code in the copier's sandbox
            return SpecError.whole_file(
                event.filename,
                f"code bundle {key!r} is not one of tenant {tenant!r}'s bundles",
                "code.tenant",
                f"submit with --code: the CLI stores the bundle under {BUNDLE_PREFIX}{tenant}/",
                path="code",
            )
        max_size = declared_max_size(event.spec_yaml)
        # read as it streams from the store, never written or held whole: the Python sources
        # only, bounded, by at most BUNDLE_SCANS scans at once (a cancelled attempt's scan keeps
        # its thread until it ends, so it is this pool's, not the default one's)
        scan = functools.partial(
            scan_bundle, self.settings, key, event.code.digest,
            functools.partial(read_bundle_sources, max_size=max_size),
            max_bytes=archive_bound(max_size),
        )  # fmt: skip
        try:
            return await self._scan_in_turn(tenant, scan)
        except ObjectMissing as exc:
            return _bundle_error(event.filename, f"code bundle missing: {exc}")
        except (BundleAltered, CodeDirError) as exc:
            return _bundle_error(event.filename, str(exc))

    async def on_submitted(self, envelope: Envelope, event: SpecSubmitted) -> Sequence[Payload]:
        """Validate one submitted spec (pure decision; bundle fetched first)."""
        # The tenant comes from the submitter's signed identity, never from the YAML.
        tenant = str(getattr(envelope, "tenant", None) or "default")
        refused = await self._handover_error(event, tenant)
        if refused is not None:
            return [SpecRejected(errors=[refused.model_dump(mode="json")])]
        code = await self._code_files(event, tenant)
        if isinstance(code, SpecError):
            return [SpecRejected(errors=[code.model_dump(mode="json")])]
        try:
            outcome: ValidationOutcome = await asyncio.to_thread(
                run_budgeted,
                validate,
                event.spec_yaml,
                event.filename,
                code or None,
                self.org_policy,
                budget=self.budget,
                tenant=tenant,
                facts=self.facts,
            )
        except BudgetExceeded as exc:
            error = _budget_error(event.filename, str(exc))
            return [SpecRejected(errors=[error.model_dump(mode="json")])]
        warnings = [w.model_dump(mode="json") for w in outcome.warnings]
        if not outcome.ok or outcome.plan is None:
            return [
                SpecRejected(
                    errors=[e.model_dump(mode="json") for e in outcome.errors], warnings=warnings
                )
            ]
        return [
            SpecValidated(
                name=outcome.plan.name,
                spec_digest=blake3.blake3(event.spec_yaml.encode()).hexdigest(),
                plan=outcome.plan,
                code=event.code,
                warnings=warnings,
            )
        ]
