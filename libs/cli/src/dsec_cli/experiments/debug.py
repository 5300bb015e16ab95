"""``dsec sandbox debug ID``: a repair sandbox with the same spec, debugging tools, and the
sandbox's recorded calls ready to replay (docs/experiments.md).

The new sandbox runs the same spec and code, with ``replay:`` the sandbox's recording (its own
``recording.saved``, or the recording it replayed itself), ``python -m dsec_sdk.debug`` as its
entrypoint (it lists the recorded calls, the failed ones first, and waits), the extra packages
of ``--with`` (e.g. ``ipdb``), ``DSEC_DEBUG=1`` and a ``--hold`` timeout. Run the agent in it
with ``dsec sandbox exec NEW -- python -m pdb agent.py``: every recorded call is answered from
the recording, none made live.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from dsec_client import DSec
    from dsec_core.events import BundleRef


class DebugError(Exception):
    """Why no repair sandbox can be made (the message says what to do)."""


def repair_spec(spec_yaml: str, recording_id: str, packages: Sequence[str], hold: str) -> str:
    """The repair sandbox's spec (see the module doc)."""
    data = yaml.safe_load(spec_yaml)
    if not isinstance(data, dict):
        raise DebugError("the sandbox's spec is not a mapping")
    data.pop("record", None)
    data["replay"] = recording_id
    data["entrypoint"] = ["python", "-m", "dsec_sdk.debug"]
    data["timeout"] = hold
    deps: list[Any] = list(data.get("dependencies") or [])
    have = {str(d.get("package", "")).lower() for d in deps if isinstance(d, dict)}
    deps += [{"package": p} for p in packages if p.lower() not in have]
    if deps:
        data["dependencies"] = deps
    context = data.setdefault("runtime_context", {}) or {}
    data["runtime_context"] = context
    env = [e for e in context.get("env_vars") or [] if e.get("name") != "DSEC_DEBUG"]
    env.append({"name": "DSEC_DEBUG", "value": "1"})
    context["env_vars"] = env
    text: str = yaml.safe_dump(data, sort_keys=False)
    return text


async def open_repair(
    d: DSec, sandbox_id: str, packages: Sequence[str], hold: str
) -> tuple[str, str, str]:
    """Submit the repair sandbox of ``sandbox_id``: (new sandbox id, recording id, its spec).

    Raises:
        DebugError: no spec on the log, or nothing recorded to replay.
    """
    from dsec_core.events import RecordingSaved, SpecSubmitted

    submitted_event = await d.last("spec.submitted", d.sandbox(sandbox_id).id)
    if submitted_event is None or not isinstance(submitted_event.payload, SpecSubmitted):
        raise DebugError(f"no sandbox {sandbox_id} on the log")
    submitted = submitted_event.payload
    saved = await d.last("recording.saved", sandbox_id)
    recording: str | None = None
    if saved is not None and isinstance(saved.payload, RecordingSaved):
        recording = saved.payload.recording_id
    else:
        replayed = (yaml.safe_load(submitted.spec_yaml) or {}).get("replay")
        recording = replayed if isinstance(replayed, str) else None
    if recording is None:
        raise DebugError(
            f"{sandbox_id} recorded nothing to replay: run it with `record: {{tools: true}}` "
            "in its spec (docs/experiments.md), then debug that run"
        )
    spec = repair_spec(submitted.spec_yaml, recording, packages, hold)
    code: BundleRef | None = submitted.code
    sandbox = await d.submit(spec, code, filename=submitted.filename)
    return sandbox.id, recording, spec
