"""``dsec schedule explain ID``: why a sandbox runs where it runs, or why it waits.

Read from the log (the sandbox's own events: an event of another sandbox copied onto its
subjects is skipped; each checked by the trust gate when a trust root is known): the latest
placement's ``unit.placed`` events (node, GPUs, share, policy, score and its breakdown, how
many nodes could have taken each unit) and ``sandbox.scheduled``, or its latest
``sandbox.pending`` (the reason, with node counts per reason).

Exit codes: 0 a decision is shown (placed or pending), 1 the scheduler has not decided yet (the
sandbox is not built, or ended before), 2 unknown sandbox id, 3 NATS unreachable.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

import typer
from rich.table import Table

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    bus,
    cli_gate,
    console,
    fail,
    print_json,
    run,
    safe_text,
)

schedule_app = typer.Typer(
    help="Placement: why a sandbox's units run where they run, or why they wait.",
    no_args_is_help=True,
)

_PLACEMENT_TYPES = frozenset({"unit.placed", "sandbox.scheduled", "sandbox.pending"})


def explain_events(sandbox_id: str, events: Iterable[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """What ``explain`` shows, from the sandbox's ``(type, payload)`` events in log order."""
    from dsec_core import lifecycle

    life = lifecycle.Lifecycle()
    units: dict[int, dict[str, dict[str, Any]]] = {}
    scheduled: dict[str, Any] | None = None
    pending: dict[str, Any] | None = None
    last: str | None = None
    seen = False
    for i, (event_type, payload) in enumerate(events):
        seen = True
        life = lifecycle.step(life, event_type, payload, event_id=str(i))
        if event_type == "unit.placed":
            attempt = int(payload.get("attempt") or 1)
            units.setdefault(attempt, {})[str(payload.get("unit"))] = payload
        elif event_type == "sandbox.scheduled" and life.last_event_id == str(i):
            scheduled, last = payload, event_type
        elif event_type == "sandbox.pending" and life.last_event_id == str(i):
            pending, last = payload, event_type
    out: dict[str, Any] = {"sandbox_id": sandbox_id, "state": life.state, "known": seen}
    if last == "sandbox.scheduled" and scheduled is not None:
        attempt = int(scheduled.get("attempt") or 1)
        placed = units.get(attempt) or {}
        out["decision"] = "placed"
        out["attempt"] = attempt
        out["node_id"] = scheduled.get("node_id")
        out["reason"] = scheduled.get("reason", "")
        out["units"] = [
            {
                "unit": name,
                "node_id": p.get("node_id"),
                "gpu_indices": p.get("gpu_indices") or [],
                "gpu_milli": p.get("gpu_milli") or 0,
                "gpu_model": p.get("gpu_model"),
                "policy": p.get("policy"),
                "score": p.get("score"),
                "breakdown": p.get("breakdown") or {},
                "feasible_nodes": p.get("feasible_nodes"),
                "nodes_total": p.get("nodes_total"),
            }
            for name, p in sorted(placed.items())
        ]
    elif last == "sandbox.pending" and pending is not None:
        out["decision"] = "pending"
        out["attempt"] = int(pending.get("attempt") or 1)
        out["reason"] = pending.get("reason", "")
        out["unit"] = pending.get("unit")
        out["unfit"] = dict(pending.get("unfit") or {})
        out["nodes_total"] = pending.get("nodes_total")
    else:
        out["decision"] = None
    return out


def summary_line(unfit: dict[str, int], nodes_total: int | None) -> str:
    """``0/1213 nodes: 800 no GPU of model V100M32, 413 insufficient GPU share``."""
    parts = ", ".join(f"{n} {r}" for r, n in sorted(unfit.items(), key=lambda kv: (-kv[1], kv[0])))
    total = "?" if nodes_total is None else str(nodes_total)
    return f"0/{total} nodes: {parts}" if parts else f"0/{total} nodes"


async def _events(sandbox_id: str) -> list[tuple[str, dict[str, Any]]]:
    from dsec_core.bus import replay
    from dsec_core.envelope import decode
    from dsec_core.lifecycle import LIFECYCLE_TYPES
    from dsec_core.subjects import InvalidSubjectToken, aggregate_filter, subject_for

    wanted = _PLACEMENT_TYPES | LIFECYCLE_TYPES
    out: list[tuple[str, dict[str, Any]]] = []
    async with bus() as (nc, js):
        gate = cli_gate(nc, js)
        try:
            filt = aggregate_filter("sandbox", sandbox_id)
        except InvalidSubjectToken:
            fail(f"{sandbox_id!r} is not a sandbox id (sbx_...)", EXIT_BAD_INPUT)
        async for seq, data in replay(js, filter_subject=filt):
            try:
                envelope = decode(data)
            except ValueError:
                continue
            if envelope.type not in wanted:
                continue
            if envelope.subject != subject_for(envelope.type, sandbox_id):
                continue  # another sandbox's event copied here: never this one's story
            if envelope.type == "unit.placed" and envelope.payload.get("sandbox_id") != sandbox_id:
                continue
            if gate is not None and await gate.authentic(data, stream_seq=seq) is None:
                continue  # forged or unauthorized: never explained as the scheduler's word
            out.append((envelope.type, dict(envelope.payload)))
    return out


@schedule_app.command("explain")
def explain(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id (sbx_...)")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Show where each compute unit of a sandbox was placed (node, GPUs, share, policy, score
    and its terms, feasible/total nodes), or why it waits (reasons with node counts).

    Exit codes: 0 shown, 1 no placement decision yet, 2 unknown sandbox, 3 NATS unreachable.
    """
    if not sandbox_id or any(c in sandbox_id for c in ".*> \t"):
        fail(f"{sandbox_id!r} is not a sandbox id (sbx_...)", EXIT_BAD_INPUT)
    found = explain_events(sandbox_id, run(_events(sandbox_id)))
    if not found["known"]:
        fail(f"no sandbox {sandbox_id!r} in the log (see `dsec sandbox list`)", EXIT_BAD_INPUT)
    if as_json:
        print_json(found)
        if found["decision"] is None:
            raise typer.Exit(EXIT_FAILED)
        return
    sid = safe_text(sandbox_id)
    if found["decision"] is None:
        fail(
            f"{sandbox_id}: no placement decision yet (state {found['state']}): the scheduler "
            "decides once its environment is built",
            EXIT_FAILED,
        )
    if found["decision"] == "pending":
        line = safe_text(summary_line(found["unfit"], found["nodes_total"]))
        console.print(
            f"[bold]{sid}[/] [yellow]pending[/] (attempt {found['attempt']}, state "
            f"{safe_text(found['state'])})",
            highlight=False,
        )
        if found["unit"]:
            console.print(f"  unit {safe_text(found['unit'])}: {line}", highlight=False)
        console.print(f"  reason: {safe_text(found['reason'])}", highlight=False, soft_wrap=True)
        if found["unfit"]:
            table = Table("WHY NOT", "NODES")
            for reason, count in sorted(found["unfit"].items(), key=lambda kv: -kv[1]):
                table.add_row(safe_text(reason), str(count))
            console.print(table)
        return
    console.print(
        f"[bold]{sid}[/] [green]placed[/] on {safe_text(str(found['node_id']))} (attempt "
        f"{found['attempt']}, state {safe_text(found['state'])}): {safe_text(found['reason'])}",
        highlight=False,
    )
    table = Table("UNIT", "NODE", "GPUS", "SHARE", "POLICY", "SCORE", "FEASIBLE", "BREAKDOWN")
    for u in found["units"]:
        gpus = ",".join(str(i) for i in u["gpu_indices"]) or "-"
        if u["gpu_model"]:
            gpus = f"{gpus} ({u['gpu_model']})"
        share = "-" if not u["gpu_indices"] else f"{u['gpu_milli'] / 1000:g} GPU each"
        terms = " ".join(f"{k}={v:.3g}" for k, v in u["breakdown"].items())
        table.add_row(
            safe_text(u["unit"]),
            safe_text(str(u["node_id"])),
            safe_text(gpus),
            share,
            safe_text(str(u["policy"])),
            f"{u['score']:.3f}" if isinstance(u["score"], int | float) else "-",
            f"{u['feasible_nodes']}/{u['nodes_total']}",
            safe_text(terms) or "-",
        )
    if not found["units"]:
        console.print("  (placed as one unit before units were recorded: no score)")
    else:
        console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``dsec schedule``."""
    app.add_typer(schedule_app, name="schedule")
