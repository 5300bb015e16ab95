"""``dsec node``: the nodes as their heartbeats show them; cordon, uncordon and drain.

``ls`` and ``show`` read the nodes read model (Postgres, fed by ``node.joined``,
``node.heartbeat``, ``node.lost`` and ``node.cordoned``). ``cordon``/``uncordon``/``drain``
publish ``node.cordon_requested`` signed with the operator's key and wait for the scheduler's
``node.cordoned`` answer.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Annotated, Any, Literal

import typer
from rich.table import Table

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_TIMEOUT,
    bus,
    cli_gate,
    confirm,
    console,
    err_console,
    fail,
    operator_identity,
    pg_connect,
    print_json,
    read_refused,
    run,
    safe_text,
    submitter,
)
from dsec_cli.render import decode_or_warn, human_size

node_app = typer.Typer(
    help="Nodes: list and inspect them (heartbeats), cordon, uncordon and drain them.",
    no_args_is_help=True,
)

SILENT_AFTER_BEATS = 3
"""A node that missed this many heartbeats (and is not yet declared lost) is ``silent``."""

_STATE_STYLE = {
    "ready": "green",
    "cordoned": "yellow",
    "draining": "yellow",
    "silent": "red",
    "lost": "bold red",
}

Action = Literal["cordon", "uncordon", "drain"]


# ---------------------------------------------------------------------- the read model


async def _rows(node_id: str | None = None) -> list[dict[str, Any]]:
    import asyncpg

    conn = await pg_connect()
    try:
        rows = await conn.fetch(
            "SELECT *, EXTRACT(EPOCH FROM now() - last_seen)::float8 AS silent_s FROM nodes"
            " WHERE ($1::text IS NULL OR node_id = $1) ORDER BY node_id",
            node_id,
        )
        return [_node(dict(r)) for r in rows]
    except asyncpg.UndefinedTableError:  # no scheduler has run yet: no node projected
        return []
    except asyncpg.InsufficientPrivilegeError:
        read_refused()
    finally:
        await conn.close()


def state_of(row: dict[str, Any]) -> str:
    """``lost``, ``draining``, ``cordoned``, ``silent`` (missed heartbeats) or ``ready``."""
    if row["lost"]:
        return "lost"
    if row["draining"]:
        return "draining"
    if row["cordoned"]:
        return "cordoned"
    if row["silent_s"] > SILENT_AFTER_BEATS * row["heartbeat_s"]:
        return "silent"
    return "ready"


def _node(row: dict[str, Any]) -> dict[str, Any]:
    """A row of the nodes table as the commands show it (JSON-ready)."""
    inv = json.loads(row["inventory"])
    sandboxes = json.loads(row["sandboxes"])
    gpus = inv.get("gpus") or []
    cpus, cpus_used = float(inv.get("cpus") or 0), float(inv.get("cpus_allocated") or 0)
    memory = int(inv.get("memory_bytes") or 0)
    memory_used = int(inv.get("memory_allocated_bytes") or 0)
    return {
        "node_id": row["node_id"],
        "state": state_of(row),
        "hostname": row["hostname"],
        "version": row["version"],
        "cpus": cpus,
        "cpus_free": round(max(0.0, cpus - cpus_used), 3),
        "memory_bytes": memory,
        "memory_free_bytes": max(0, memory - memory_used),
        "gpus": dict(Counter(str(g.get("model")) for g in gpus)),
        "gpu_probe": inv.get("gpu_probe"),
        "sandboxes": sandboxes,
        "max_sandboxes": inv.get("max_sandboxes"),
        "labels": inv.get("labels") or {},
        "problems": json.loads(row["problems"]),
        "cordoned": row["cordoned"],
        "draining": row["draining"],
        "cordon_reason": row["cordon_reason"],
        "lost": row["lost"],
        "joined_at": row["joined_at"],
        "last_seen": row["last_seen"],
        "silent_s": round(row["silent_s"], 1),
        "heartbeat_s": row["heartbeat_s"],
        "seq": row["seq"],
        "inventory": inv,
    }


def _gpus_text(gpus: dict[str, int]) -> str:
    return ", ".join(f"{model}×{count}" for model, count in gpus.items()) or "-"


def _styled_state(node: dict[str, Any]) -> str:
    style = _STATE_STYLE.get(node["state"], "")
    text = node["state"] + (f" ({len(node['problems'])} problems)" if node["problems"] else "")
    return f"[{style}]{safe_text(text)}[/]" if style else safe_text(text)


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{max(seconds, 0):.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


@node_app.command("ls")
def ls(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """List the nodes: state, free CPUs and memory, GPUs, sandboxes, last heartbeat.

    States: ready; cordoned (no new sandboxes); draining (its sandboxes move away); silent
    (missed 3 heartbeats); lost (the scheduler gave up on it and rescheduled its sandboxes).
    """
    nodes = run(_rows())
    if as_json:
        print_json([{k: v for k, v in n.items() if k != "inventory"} for n in nodes])
        return
    table = Table()
    for column in ("node", "state", "CPUs free/total", "memory free/total", "GPUs"):
        table.add_column(column, no_wrap=column == "node")
    table.add_column("sandboxes", justify="right")
    table.add_column("last seen")
    for n in nodes:
        table.add_row(
            safe_text(n["node_id"]),
            _styled_state(n),
            f"{n['cpus_free']:g}/{n['cpus']:g}",
            f"{human_size(n['memory_free_bytes'])}/{human_size(n['memory_bytes'])}",
            safe_text(_gpus_text(n["gpus"])),
            f"{len(n['sandboxes'])}/{n['max_sandboxes']}",
            _ago(n["silent_s"]),
        )
    console.print(table)
    if not nodes:
        console.print("no node has joined yet (is a node agent running? `dsec status`)")


@node_app.command("show")
def show(
    node_id: Annotated[str, typer.Argument(help="The node (see `dsec node ls`)")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Show one node in full: inventory, each GPU, sandboxes, problems."""
    nodes = run(_rows(node_id))
    if not nodes:
        fail(f"no node {node_id!r} has joined (see `dsec node ls`)", EXIT_BAD_INPUT)
    node = nodes[0]
    if as_json:
        print_json(node)
        return
    inv = node["inventory"]
    console.print(
        f"[bold]{safe_text(node['node_id'])}[/] ({safe_text(node['hostname'] or '?')}, "
        f"node agent {safe_text(node['version'] or '?')}) — {_styled_state(node)}",
        highlight=False,
    )
    if node["cordon_reason"]:
        console.print(f"  cordon reason: {safe_text(node['cordon_reason'])}", highlight=False)
    lines = [
        ("CPUs", f"{node['cpus_free']:g} free of {node['cpus']:g}; load {inv.get('load1')}"),
        (
            "memory",
            f"{human_size(node['memory_free_bytes'])} free of {human_size(node['memory_bytes'])}"
            f"; host available {human_size(int(inv.get('memory_available_bytes') or 0))}",
        ),
        ("disk free", human_size(int(inv.get("disk_free_bytes") or 0))),
        ("sandboxes", f"{len(node['sandboxes'])} of at most {node['max_sandboxes']}"),
        ("labels", ", ".join(f"{k}={v}" for k, v in node["labels"].items()) or "-"),
        ("GPUs", f"{len(inv.get('gpus') or [])} ({node['gpu_probe']})"),
        ("last seen", f"{_ago(node['silent_s'])} (heartbeat {node['seq']}, every "
                      f"{node['heartbeat_s']:g} s); joined {node['joined_at']}"),
    ]  # fmt: skip
    for label, text in lines:
        console.print(f"  {label:<10} {safe_text(text)}", highlight=False)
    for g in inv.get("gpus") or []:
        console.print(f"  {safe_text(_gpu_line(g))}", highlight=False)
    for sandbox in node["sandboxes"]:
        console.print(f"  sandbox {safe_text(sandbox)}", highlight=False)
    for problem in node["problems"]:
        console.print(f"  [red]problem[/] {safe_text(problem)}", highlight=False)


def _gpu_line(g: dict[str, Any]) -> str:
    used, total = int(g.get("memory_used_bytes") or 0), int(g.get("memory_total_bytes") or 0)
    parts = [
        f"GPU {g.get('index')} {g.get('model')} {g.get('uuid')}",
        f"{human_size(used)}/{human_size(total)}",
    ]
    for key, label in (("temperature_c", "°C"), ("utilization_pct", "% busy")):
        if g.get(key) is not None:
            parts.append(f"{g[key]:g}{label}")
    if g.get("ecc_uncorrected") is not None:
        parts.append(f"ECC {g.get('ecc_corrected')}/{g['ecc_uncorrected']} (corr/uncorr)")
    if g.get("xid_errors"):
        parts.append(f"XID errors {g['xid_errors']}")
    if g.get("mig_enabled"):
        parts.append("MIG")
    active = [str(link["link"]) for link in g.get("nvlinks") or [] if link.get("active")]
    if active:
        parts.append(f"NVLinks up: {','.join(active)}")
    if g.get("topology"):
        parts.append("peers " + " ".join(f"{p}={v}" for p, v in g["topology"].items()))
    return "; ".join(parts)


# ---------------------------------------------------------------------- cordon / drain


def answers(action: Action, payload: dict[str, Any]) -> bool:
    """Whether a ``node.cordoned`` state is what ``action`` asked for."""
    if action == "uncordon":
        return not payload.get("cordoned") and not payload.get("draining")
    if action == "drain":
        return bool(payload.get("draining"))
    return bool(payload.get("cordoned"))


async def _request(action: Action, node_id: str, reason: str, timeout: float) -> Any:
    """Publish the operator's request; return the scheduler's ``node.cordoned`` envelope."""
    from dsec_core.bus import EventPublisher, follow
    from dsec_core.events import NodeCordonRequested
    from dsec_core.signing import Signer
    from dsec_core.subjects import STREAM, filter_for

    key, cert = operator_identity()
    async with bus() as (nc, js):
        start = (await js.stream_info(STREAM)).state.last_seq + 1
        publisher = EventPublisher(js, Signer(cert.subject, key), certificate=cert)
        await publisher.register_key()
        gate = cli_gate(nc, js)
        request = NodeCordonRequested(
            node_id=node_id, action=action, reason=reason, requested_by=submitter()
        )
        request_id = (await publisher.publish(request, aggregate_id=node_id)).envelope.id
        err_console.print(
            f"{action} of {safe_text(node_id)} requested; waiting up to {timeout:g} s for the "
            "scheduler",
            highlight=False,
        )
        deadline = time.monotonic() + timeout
        subject = filter_for("node.cordoned", node_id)
        async for batch in follow(js, filter_subject=subject, start_seq=start, idle_s=0.25):
            for seq, data in batch:
                env = decode_or_warn(seq, data)
                if env is None or (gate is not None and await gate.authentic(data) is None):
                    err_console.print(f"[yellow]ignored[/] an unauthentic answer at seq {seq}")
                    continue
                if env.causation_id == request_id or answers(action, env.payload):
                    return env
            if time.monotonic() > deadline:
                return None
    return None


def _cordon(action: Action, node_id: str, reason: str, timeout: float, as_json: bool) -> None:
    from dsec_core.subjects import InvalidSubjectToken, subject_for

    try:
        subject_for("node.cordon_requested", node_id)
    except InvalidSubjectToken as exc:
        fail(f"node id: {exc}", EXIT_BAD_INPUT)
    with err_console.status(f"{action} {safe_text(node_id)}: waiting for the scheduler"):
        answer = run(_request(action, node_id, reason, timeout))
    if answer is None:
        fail(
            f"no answer to {action} {node_id} within {timeout:g} s: is the scheduler running? "
            "(`dsec status`); the request stays in the log and is acted on when it starts",
            EXIT_TIMEOUT,
        )
    p = answer.payload
    ok = answers(action, p)
    if as_json:
        print_json({"node_id": node_id, "action": action, "ok": ok, **p})
    elif ok:
        state = "draining" if p.get("draining") else "cordoned" if p.get("cordoned") else "ready"
        moved = f"; moved {len(p.get('moved') or [])} sandboxes" if action == "drain" else ""
        console.print(f"{safe_text(node_id)}: {state}{safe_text(moved)}", highlight=False)
        for sandbox in p.get("moved") or []:
            console.print(f"  moved {safe_text(sandbox)}", highlight=False)
    else:
        err_console.print(
            f"[bold red]error:[/] the scheduler did not {action} {safe_text(node_id)}: "
            f"{safe_text(p.get('reason') or 'no reason given')}",
            highlight=False,
        )
    if not ok:
        raise typer.Exit(EXIT_FAILED)


_TIMEOUT_HELP = "Seconds to wait for the scheduler's answer"
_REASON_HELP = "Why (recorded in the log)"


_Node = Annotated[str, typer.Argument(help="The node")]
_Reason = Annotated[str, typer.Option(help=_REASON_HELP)]
_Timeout = Annotated[float, typer.Option(help=_TIMEOUT_HELP)]
_Json = Annotated[bool, typer.Option("--json", help="Machine-readable result")]


@node_app.command("cordon")
def cordon(
    node_id: _Node,
    reason: _Reason = "",
    timeout: _Timeout = 30.0,
    as_json: _Json = False,
) -> None:
    """Place no new sandbox on a node (operator only); its running sandboxes stay.

    Exit 0 cordoned; 1 the scheduler refused; 2 bad input or not the operator; 3 unreachable;
    4 no answer in time.
    """
    _cordon("cordon", node_id, reason, timeout, as_json)


@node_app.command("uncordon")
def uncordon(
    node_id: _Node,
    reason: _Reason = "",
    timeout: _Timeout = 30.0,
    as_json: _Json = False,
) -> None:
    """Let the scheduler place sandboxes on a node again (operator only). Exit codes as
    ``cordon``."""
    _cordon("uncordon", node_id, reason, timeout, as_json)


@node_app.command("drain")
def drain(
    node_id: _Node,
    reason: _Reason = "",
    timeout: _Timeout = 30.0,
    as_json: _Json = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
) -> None:
    """Cordon a node and move its sandboxes to others (operator only). Exit codes as
    ``cordon``."""
    confirm(f"drain node {node_id} (its sandboxes are stopped and placed elsewhere)", yes)
    _cordon("drain", node_id, reason, timeout, as_json)


def register(app: typer.Typer) -> None:
    """Add ``dsec node``."""
    app.add_typer(node_app, name="node")
