"""Scripted health of the simulated fleet (``--script FILE``, YAML)::

    steps:
      - {at: 30, node: sim-3, gpu: 2, temperature: 92, over: 30}  # heats up to 92 °C in 30 s
      - {at: 45, node: sim-5, gpu: 1, xid: 79}                     # XID 79: fallen off the bus
      - {at: 60, node: sim-7, crash: true}                         # stops heartbeating
      - {at: 120, node: sim-7, recover: true}                      # starts again (node.joined)
      - {at: 0, node: "sim-1*", run_for: 600}                      # its units run 600 s
      - {at: 50, node: sim-2, gpu: 0, xid: 48, count: 3}           # an XID burst (3 × XID 48)
      - {at: 55, node: sim-2, gpu: 1, ecc: 2}                      # 2 uncorrected ECC errors
      - {at: 60, node: sim-2, gpu: 3, throttle: [hw_thermal]}      # clocks throttled ([]: none)
      - {at: 70, node: sim-4, gpu: 0, nvlink_utilization: 96}      # its NVLinks 96 % busy
      - {at: 75, node: sim-4, gpu: 0, nvlink_errors: 500}          # 500 replay/CRC errors
      - {at: 90, node: sim-2, gpu: all, heal: true}                # reset: healthy and idle-cool

``at`` is seconds since the fleet joined; ``node`` an id or a glob (``sim-1*``, ``*``); ``gpu``
an index or ``all``. Exactly one action per step: ``temperature`` (with ``over``, default 0),
``xid`` (an XID code; ``count`` of them, default 1), ``ecc`` (uncorrected errors), ``throttle``
(NVML clock throttle reasons), ``nvlink_utilization`` (percent, every active link of the GPU),
``nvlink_errors`` (errors added on each active link), ``heal`` (a GPU reset: counters, throttle
and links cleared, back to its resting temperature), ``crash``, ``recover`` or ``run_for``.
Errors name the step and field.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dsec_fleetsim.inventory import InventoryError

ThrottleReason = Literal[
    "gpu_idle",
    "applications_clocks",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal",
    "hw_thermal",
    "hw_power_brake",
    "display_clocks",
]

ACTIONS = (
    "temperature",
    "xid",
    "crash",
    "recover",
    "run_for",
    "ecc",
    "throttle",
    "nvlink_utilization",
    "nvlink_errors",
    "heal",
)
GPU_ACTIONS = frozenset(
    {"temperature", "xid", "ecc", "throttle", "nvlink_utilization", "nvlink_errors", "heal"}
)


class ScriptError(InventoryError):
    """A script that cannot be run; the message names the step and field."""


class Step(BaseModel):
    """One scripted change."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    at: float = Field(ge=0, le=30 * 86400, description="Seconds after the fleet joined")
    node: str = Field(min_length=1, max_length=200, description="Node id or glob")
    gpu: int | Literal["all"] | None = Field(default=None, description="GPU index, or all")
    temperature: float | None = Field(default=None, ge=0, le=150)
    over: float = Field(default=0.0, ge=0, le=86400, description="Ramp time of temperature")
    xid: int | None = Field(default=None, ge=1, le=1000)
    count: int = Field(default=1, ge=1, le=10_000, description="XIDs of a burst")
    ecc: int | None = Field(default=None, ge=1, le=10_000, description="Uncorrected ECC errors")
    throttle: list[ThrottleReason] | None = Field(default=None, max_length=9)
    nvlink_utilization: float | None = Field(default=None, ge=0, le=100)
    nvlink_errors: int | None = Field(default=None, ge=1, le=10**9)
    heal: bool = False
    crash: bool = False
    recover: bool = False
    run_for: float | None = Field(default=None, gt=0, le=30 * 86400)

    @model_validator(mode="after")
    def _one_action(self) -> Step:
        given = [a for a in ACTIONS if getattr(self, a) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"exactly one action of {', '.join(ACTIONS)}; got "
                + (", ".join(given) if given else "none")
            )
        if given[0] in GPU_ACTIONS and self.gpu is None:
            raise ValueError(f"{given[0]} needs gpu: an index or all")
        if isinstance(self.gpu, int) and self.gpu < 0:
            raise ValueError("gpu: an index from 0, or all")
        return self

    @property
    def action(self) -> str:
        return next(a for a in ACTIONS if getattr(self, a) not in (None, False))

    def nodes(self, ids: Sequence[str]) -> list[str]:
        """The node ids this step applies to."""
        if any(c in self.node for c in "*?["):
            return fnmatch.filter(ids, self.node)
        return [self.node] if self.node in ids else []


class Script(BaseModel):
    """A script: its steps, in time order once loaded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: list[Step] = Field(default_factory=list, max_length=100_000)


def parse_script(text: str, where: str = "script.yaml", ids: Sequence[str] = ()) -> list[Step]:
    """The steps of a script, sorted by ``at``; ``ids``: the fleet's nodes (a step naming none
    of them is an error).

    Raises:
        ScriptError: ``FILE: steps[i].field: what is wrong``.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScriptError(f"{where}: not valid YAML: {exc}") from None
    if isinstance(data, list):
        data = {"steps": data}
    if not isinstance(data, dict):
        raise ScriptError(f"{where}: expected steps: [...]")
    try:
        script = Script.model_validate(data)
    except ValidationError as exc:
        parts = []
        for e in exc.errors():
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"])
            parts.append(f"{loc.lstrip('.') or '(top level)'}: {e['msg']}")
        raise ScriptError(f"{where}: " + "; ".join(parts)) from None
    if ids:
        for i, step in enumerate(script.steps):
            if not step.nodes(ids):
                raise ScriptError(f"{where}: steps[{i}].node: {step.node!r} names no node")
    return sorted(script.steps, key=lambda s: s.at)


def load_script(path: Path, ids: Sequence[str] = ()) -> list[Step]:
    """:func:`parse_script` of a file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScriptError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_script(text, str(path), ids)
