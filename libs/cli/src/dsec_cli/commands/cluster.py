"""``dsec cluster config``: the operator's cluster settings (GPU health thresholds, slicing).

``set KEY VALUE`` publishes ``cluster.config_set`` signed with the operator's key, carrying every
setting in force after the change (node agents and the simulated fleet read the latest one);
``show`` reads that latest authentic event and lists every key with its value and whether it is
the default. Keys, defaults and valid values: ``dsec_core.gpuhealth.CONFIG_KEYS`` (docs/gpu.md).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    bus,
    cli_gate,
    console,
    fail,
    operator_identity,
    print_json,
    run,
    safe_text,
    submitter,
)

cluster_app = typer.Typer(help="Cluster-wide operator settings.", no_args_is_help=True)
config_app = typer.Typer(
    help="GPU health thresholds and slicing modes (operator only to set).", no_args_is_help=True
)
cluster_app.add_typer(config_app, name="config")

_Json = Annotated[bool, typer.Option("--json", help="Machine-readable result")]


async def _latest(nc: Any, js: Any) -> tuple[dict[str, str], Any]:
    """The settings of the latest authentic ``cluster.config_set`` (none: empty), and that
    event's envelope (``None``)."""
    from dsec_core.events import ClusterConfigSet
    from dsec_core.gpuhealth import CONFIG_ID
    from dsec_core.subjects import subject_for

    gate = cli_gate(nc, js)
    if gate is None:
        return {}, None
    found, _ = await gate.newest(subject_for(ClusterConfigSet.TYPE, CONFIG_ID))
    if found is None:
        return {}, None
    payload = found.decoded()
    assert isinstance(payload, ClusterConfigSet)
    return dict(payload.config), found


async def _show() -> dict[str, str]:
    async with bus() as (nc, js):
        return (await _latest(nc, js))[0]


async def _set(key: str, value: str) -> dict[str, Any]:
    from dsec_core.bus import EventPublisher
    from dsec_core.events import ClusterConfigSet
    from dsec_core.gpuhealth import CONFIG_ID, CONFIG_KEYS, ClusterConfig
    from dsec_core.signing import Signer

    key_pair, cert = operator_identity()
    async with bus() as (nc, js):
        values, in_force = await _latest(nc, js)
        # The settings in force are the ones signed last (a copy of an older one, published
        # again, never wins): a clock behind theirs would make this change one nobody takes.
        now = datetime.now(UTC)
        if in_force is not None and now <= in_force.time:
            fail(
                f"the settings in force were signed at {in_force.time.isoformat()}, later than "
                f"this machine's clock ({now.isoformat()}): nodes take the setting signed last, "
                "so this one would be ignored; set the clock right and try again",
                EXIT_BAD_INPUT,
            )
        current = ClusterConfig.of(values)
        updated = current.with_value(key, value)
        publisher = EventPublisher(js, Signer(cert.subject, key_pair), certificate=cert)
        await publisher.register_key()
        previous = current.values.get(key, CONFIG_KEYS[key].default)
        event = ClusterConfigSet(
            key=key,
            value=updated.values[key],
            previous=previous,
            config=dict(sorted(updated.values.items())),
            requested_by=submitter(),
        )
        published = await publisher.publish(event, aggregate_id=CONFIG_ID)
        return {"event_id": published.envelope.id, **event.model_dump(mode="json")}


@config_app.command("set")
def set_(
    key: Annotated[str, typer.Argument(help="A key, e.g. gpu.temperature_c")],
    value: Annotated[str, typer.Argument(help="Its value, e.g. 85")],
    as_json: _Json = False,
) -> None:
    """Set one cluster setting (operator only; every node reads it within a heartbeat or two).

    Exit 0 set; 2 an unknown key, a bad value or not the operator; 3 NATS unreachable.
    """
    from dsec_core.gpuhealth import ConfigError, parse_value

    try:
        parse_value(key, value)
    except ConfigError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    result = run(_set(key, value))
    if as_json:
        print_json(result)
        return
    console.print(
        f"{safe_text(key)} = {safe_text(result['value'])} (was {safe_text(result['previous'])})",
        highlight=False,
    )


@config_app.command("show")
def show(as_json: _Json = False) -> None:
    """Every cluster setting: its value, whether the operator set it, what it does.

    Exit 0 shown; 3 NATS unreachable.
    """
    from dsec_core.gpuhealth import CONFIG_KEYS, ClusterConfig

    config = ClusterConfig.of(run(_show()))
    rows: list[dict[str, Any]] = [
        {"key": k, "value": v, "set": is_set, "default": CONFIG_KEYS[k].default,
         "help": CONFIG_KEYS[k].help}
        for k, (v, is_set) in config.effective().items()
    ]  # fmt: skip
    if as_json:
        print_json(rows)
        return
    table = Table("KEY", "VALUE", "SET", "MEANING")
    for r in rows:
        table.add_row(
            safe_text(r["key"]), safe_text(r["value"]), "yes" if r["set"] else "default", r["help"]
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``dsec cluster``."""
    app.add_typer(cluster_app, name="cluster")
