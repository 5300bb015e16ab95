"""GPU health: thresholds, the operator's cluster config, and the hysteresis that turns readings
into ``gpu.degraded`` / ``gpu.recovered`` / ``link.congested`` (pure: no NVML, no bus).

One module for every producer and reader: the node agent (NVML readings each heartbeat), the
simulated fleet's nodes (scripted readings), the CLI (``dsec cluster config set|show``
validates keys with :func:`parse_value`) and the scheduler (whose degraded-GPU bookkeeping
folds the events).

* :class:`Thresholds`: when a GPU is degraded. Defaults are the operator's (``cluster.config_set``
  events, :class:`ClusterConfig`); a spec's ``migration.thresholds`` can only make a unit's own
  limits stricter (the scheduler's migration control reads them).
* :class:`HealthTracker`: per node, fed a list of :class:`GpuReading` at each check; returns the
  events to publish. A signal enters at its threshold and leaves with hysteresis: the
  temperature must fall ``recover_margin_c`` below it; XID/ECC/throttle/lost must stay quiet for
  ``recover_after_s``. One ``gpu.degraded`` per signal that enters, one ``gpu.recovered`` when the
  last signal has left. A link is congested at ``nvlink_utilization_pct`` (``warn``) or at
  ``nvlink_errors`` new replay/recovery/CRC errors since the last check (``pcie_fallback``: the
  link is unreliable, peer traffic should go over PCIe), and re-armed 10 points below / without
  new errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dsec_core.events import GpuDegraded, GpuRecovered, LinkCongested, Payload

THROTTLE_REASONS: Mapping[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}
"""NVML's clock throttle reasons (``nvmlClocksThrottleReason*`` / ``nvmlClocksEventReason*``)
by the names used here."""

BAD_THROTTLE: tuple[str, ...] = ("hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake")
"""Throttle reasons that mean trouble (not idling or a power cap an operator set)."""

LINK_REARM_PCT = 10.0
"""A congested link is re-armed this many points below its utilization threshold."""


def throttle_names(mask: int) -> frozenset[str]:
    """NVML's throttle reason bit mask as names."""
    return frozenset(name for name, bit in THROTTLE_REASONS.items() if mask & bit)


class Thresholds(BaseModel):
    """When a GPU is degraded (a count threshold of 0 turns that signal off)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature_c: float = Field(default=85.0, ge=30, le=110, description="°C: degraded at")
    recover_margin_c: float = Field(
        default=5.0, ge=0, le=50, description="°C below temperature_c before it recovers"
    )
    xid_errors: int = Field(default=1, ge=0, le=10_000, description="New XIDs per check; 0: off")
    ecc_uncorrected: int = Field(
        default=1, ge=0, le=10_000, description="New uncorrected ECC errors per check; 0: off"
    )
    throttle: tuple[str, ...] = Field(
        default=BAD_THROTTLE, max_length=len(THROTTLE_REASONS), description="Reasons that degrade"
    )
    nvlink_errors: int = Field(
        default=100, ge=0, le=10**9, description="New NVLink errors per check on a link; 0: off"
    )
    nvlink_utilization_pct: float = Field(
        default=90.0, ge=1, le=100, description="NVLink utilization that is congestion"
    )
    recover_after_s: float = Field(
        default=30.0, ge=0, le=86400, description="Quiet seconds before XID/ECC/throttle clear"
    )

    def strictest(self, other: Mapping[str, Any]) -> Thresholds:
        """These thresholds made stricter by ``other`` (a spec's ``migration.thresholds``):
        lower temperatures and counts win; a count of 0 (off) never loosens one that is on."""
        update: dict[str, Any] = {}
        for key in ("temperature_c", "nvlink_utilization_pct"):
            if other.get(key) is not None:
                update[key] = min(float(other[key]), getattr(self, key))
        for key in ("xid_errors", "ecc_uncorrected", "nvlink_errors"):
            value = other.get(key)
            if value:
                mine = getattr(self, key)
                update[key] = min(int(value), mine) if mine else int(value)
        return self.model_copy(update=update)


# --------------------------------------------------------------------------- cluster config


class ConfigError(ValueError):
    """A cluster config key or value that cannot be used (the message says what is valid)."""


@dataclass(frozen=True)
class ConfigKey:
    """One operator setting."""

    name: str
    default: str
    help: str
    parse: Callable[[str], Any]


def _number(lo: float, hi: float, whole: bool = False) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value: float = int(text) if whole else float(text)
        except ValueError:
            kind = "a whole number" if whole else "a number"
            raise ConfigError(f"{text!r} is not {kind}; valid: {lo:g} to {hi:g}") from None
        if not math.isfinite(value) or not lo <= value <= hi:
            raise ConfigError(f"{text!r} is out of range; valid: {lo:g} to {hi:g}")
        return value

    return parse


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("on", "true", "yes", "1"):
        return True
    if lowered in ("off", "false", "no", "0"):
        return False
    raise ConfigError(f"{text!r} is not on/off; valid: on, off (true/false, yes/no, 1/0)")


def _reasons(text: str) -> tuple[str, ...]:
    names = tuple(sorted({p.strip() for p in text.split(",") if p.strip()}))
    unknown = [n for n in names if n not in THROTTLE_REASONS]
    if unknown:
        raise ConfigError(
            f"unknown throttle reason {unknown[0]!r}; valid (comma-separated): "
            + ", ".join(THROTTLE_REASONS)
        )
    return names


CONFIG_KEYS: Mapping[str, ConfigKey] = {
    k.name: k
    for k in (
        ConfigKey(
            "gpu.temperature_c", "85", "GPU temperature (°C) that degrades it", _number(30, 110)
        ),
        ConfigKey(
            "gpu.recover_margin_c",
            "5",
            "°C below gpu.temperature_c before it recovers",
            _number(0, 50),
        ),
        ConfigKey(
            "gpu.xid_errors",
            "1",
            "new XID errors per check that degrade a GPU (0: off)",
            _number(0, 10_000, True),
        ),
        ConfigKey(
            "gpu.ecc_uncorrected",
            "1",
            "new uncorrected ECC errors per check that degrade a GPU (0: off)",
            _number(0, 10_000, True),
        ),
        ConfigKey(
            "gpu.throttle",
            ",".join(sorted(BAD_THROTTLE)),
            "throttle reasons that degrade a GPU (comma-separated; empty: off)",
            _reasons,
        ),
        ConfigKey(
            "gpu.nvlink_errors",
            "100",
            "new NVLink errors per check on one link that congest it (0: off)",
            _number(0, 10**9, True),
        ),
        ConfigKey(
            "gpu.nvlink_utilization_pct",
            "90",
            "NVLink utilization (%) that is congestion",
            _number(1, 100),
        ),
        ConfigKey(
            "gpu.recover_after_s",
            "30",
            "quiet seconds before XID/ECC/throttle/lost clear",
            _number(0, 86400),
        ),
        ConfigKey("gpu.mig", "off", "slice MIG-capable GPUs with MIG instances (on/off)", _bool),
        ConfigKey(
            "gpu.mps",
            "on",
            "slice other GPUs with an MPS server per GPU (on/off; off: time-slicing)",
            _bool,
        ),
        ConfigKey(
            "gpu.memory_grace_s",
            "5",
            "seconds a unit may stay over its GPU memory quota before it is stopped",
            _number(0, 3600),
        ),
        ConfigKey(
            "gpu.memory_warn_pct",
            "90",
            "share (%) of its GPU memory quota at which a unit is warned",
            _number(1, 100),
        ),
    )
}
"""Every key ``dsec cluster config set`` accepts, with its default."""


def parse_value(key: str, value: str) -> str:
    """``value`` checked for ``key``, in its canonical spelling.

    Raises:
        ConfigError: an unknown key (the valid ones listed) or a bad value (the range named).
    """
    spec = CONFIG_KEYS.get(key)
    if spec is None:
        raise ConfigError(f"unknown key {key!r}; valid: {', '.join(CONFIG_KEYS)}")
    try:
        parsed = spec.parse(value)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if isinstance(parsed, bool):
        return "on" if parsed else "off"
    if isinstance(parsed, tuple):
        return ",".join(parsed)
    if isinstance(parsed, float) and parsed.is_integer():
        return str(int(parsed))
    return str(parsed)


CONFIG_ID = "config"
"""The aggregate id of ``cluster.config_set`` (subject ``dsec.cluster.config.config_set``)."""


@dataclass(frozen=True)
class ClusterConfig:
    """The operator's settings in force (the latest ``cluster.config_set`` carries them all)."""

    values: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, values: Mapping[str, str] | None) -> ClusterConfig:
        """Known keys with valid values only (a newer writer's keys, or a value this version
        cannot read, are left at their default)."""
        kept: dict[str, str] = {}
        for key, value in (values or {}).items():
            try:
                kept[key] = parse_value(key, str(value))
            except ConfigError:
                continue
        return cls(kept)

    def get(self, key: str) -> Any:
        spec = CONFIG_KEYS[key]
        return spec.parse(self.values.get(key, spec.default))

    def with_value(self, key: str, value: str) -> ClusterConfig:
        return ClusterConfig({**self.values, key: parse_value(key, value)})

    def effective(self) -> dict[str, tuple[str, bool]]:
        """Every key: (value, whether the operator set it)."""
        return {
            k: (self.values.get(k, spec.default), k in self.values)
            for k, spec in CONFIG_KEYS.items()
        }

    def thresholds(self) -> Thresholds:
        return Thresholds(
            temperature_c=self.get("gpu.temperature_c"),
            recover_margin_c=self.get("gpu.recover_margin_c"),
            xid_errors=self.get("gpu.xid_errors"),
            ecc_uncorrected=self.get("gpu.ecc_uncorrected"),
            throttle=self.get("gpu.throttle"),
            nvlink_errors=self.get("gpu.nvlink_errors"),
            nvlink_utilization_pct=self.get("gpu.nvlink_utilization_pct"),
            recover_after_s=self.get("gpu.recover_after_s"),
        )


# --------------------------------------------------------------------------- readings


@dataclass(frozen=True, slots=True)
class LinkReading:
    """One NVLink now: its utilization and its error counters' sum since start."""

    link: int
    peer_gpu_index: int | None = None
    utilization_pct: float | None = None
    errors_total: int | None = None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """What the health check reads of one GPU (``present`` False: NVML lost it)."""

    index: int
    uuid: str = ""
    temperature_c: float | None = None
    xid_total: int | None = None
    ecc_uncorrected_total: int | None = None
    throttle: frozenset[str] = frozenset()
    links: tuple[LinkReading, ...] = ()
    present: bool = True


Signal = Literal["temperature", "xid", "ecc", "throttle", "lost"]


@dataclass
class _LinkState:
    errors: int | None = None
    congested: bool = False


@dataclass
class _GpuState:
    uuid: str = ""
    bad: dict[str, float] = field(default_factory=dict)
    """Signal -> when it was last seen bad."""
    since: float | None = None
    xids: int | None = None
    ecc: int | None = None
    links: dict[int, _LinkState] = field(default_factory=dict)


@dataclass
class HealthTracker:
    """One node's GPUs, judged against ``thresholds`` at each :meth:`observe` (see module)."""

    node_id: str
    source: Literal["nvml", "declared", "simulated"] = "nvml"
    thresholds: Thresholds = field(default_factory=Thresholds)
    gpus: dict[int, _GpuState] = field(default_factory=dict)

    def track(self, index: int, uuid: str = "") -> None:
        """Know a GPU before its first reading (one missing from that reading is ``lost``)."""
        self.gpus.setdefault(index, _GpuState(uuid=uuid))

    def degraded(self) -> dict[int, tuple[str, ...]]:
        """GPU index -> its signals now (degraded GPUs only)."""
        return {i: tuple(sorted(s.bad)) for i, s in self.gpus.items() if s.bad}

    def observe(self, now: float, readings: Iterable[GpuReading]) -> list[Payload]:
        """The events the readings at ``now`` call for (empty while nothing changes)."""
        out: list[Payload] = []
        seen: set[int] = set()
        for r in readings:
            seen.add(r.index)
            state = self.gpus.setdefault(r.index, _GpuState(uuid=r.uuid))
            state.uuid = r.uuid or state.uuid
            out += self._gpu(now, r, state)
        for index, state in self.gpus.items():
            if index not in seen:  # NVML no longer lists it: fallen off the bus
                out += self._gpu(now, GpuReading(index, state.uuid, present=False), state)
        return out

    def _gpu(self, now: float, r: GpuReading, state: _GpuState) -> list[Payload]:
        t = self.thresholds
        out: list[Payload] = []
        was_bad = bool(state.bad)
        crossed: list[tuple[str, float, float, str, str]] = []

        def enter(signal: str, value: float, threshold: float, detail: str, sev: str) -> None:
            if signal not in state.bad:
                crossed.append((signal, value, threshold, detail, sev))
            state.bad[signal] = now

        def quiet(signal: str) -> None:
            last = state.bad.get(signal)
            if last is not None and now - last >= t.recover_after_s:
                del state.bad[signal]

        if not r.present:
            enter("lost", 1, 1, f"GPU {r.index} ({r.uuid}) no longer answers NVML", "critical")
        elif "lost" in state.bad:
            quiet("lost")
        if r.temperature_c is not None:
            if r.temperature_c >= t.temperature_c:
                enter(
                    "temperature", r.temperature_c, t.temperature_c,
                    f"GPU {r.index} at {r.temperature_c:g} °C (threshold {t.temperature_c:g} °C)",
                    "critical",
                )  # fmt: skip
            elif r.temperature_c <= t.temperature_c - t.recover_margin_c:
                state.bad.pop("temperature", None)
        for signal, total, last_attr, threshold, what in (
            ("xid", r.xid_total, "xids", t.xid_errors, "XID errors"),
            ("ecc", r.ecc_uncorrected_total, "ecc", t.ecc_uncorrected, "uncorrected ECC errors"),
        ):
            if total is None:
                continue
            previous = getattr(state, last_attr)
            new = total - (previous or 0) if previous is None or total >= previous else total
            setattr(state, last_attr, total)
            if threshold and new >= threshold:
                enter(signal, new, threshold, f"GPU {r.index}: {new} new {what}", "critical")
            else:
                quiet(signal)
        bad_throttle = sorted(r.throttle & set(t.throttle))
        if r.present and bad_throttle:
            enter(
                "throttle", len(bad_throttle), 1,
                f"GPU {r.index} throttled: {', '.join(bad_throttle)}", "warning",
            )  # fmt: skip
        else:
            quiet("throttle")
        for name, figure, limit, detail, severity in crossed:
            if state.since is None:
                state.since = now
            out.append(
                GpuDegraded(
                    node_id=self.node_id,
                    gpu_index=r.index,
                    gpu_uuid=state.uuid,
                    signal=name,
                    value=float(figure),
                    threshold=float(limit),
                    severity=severity,
                    detail=detail[:500],
                    source=self.source,
                )
            )
        if was_bad and not state.bad:
            since = state.since if state.since is not None else now
            state.since = None
            out.append(
                GpuRecovered(
                    node_id=self.node_id,
                    gpu_index=r.index,
                    gpu_uuid=state.uuid,
                    degraded_s=round(max(0.0, now - since), 3),
                )
            )
        if r.present:
            out += self._links(r, state)
        return out

    def _links(self, r: GpuReading, state: _GpuState) -> list[Payload]:
        t = self.thresholds
        out: list[Payload] = []
        for link in r.links:
            ls = state.links.setdefault(link.link, _LinkState())
            new = 0
            if link.errors_total is not None:
                if ls.errors is not None and link.errors_total >= ls.errors:
                    new = link.errors_total - ls.errors
                ls.errors = link.errors_total
            util = link.utilization_pct
            erroring = bool(t.nvlink_errors) and new >= t.nvlink_errors
            busy = util is not None and util >= t.nvlink_utilization_pct
            if (erroring or busy) and not ls.congested:
                ls.congested = True
                peer = "" if link.peer_gpu_index is None else f" to GPU {link.peer_gpu_index}"
                why = (
                    f"{new} new errors (threshold {t.nvlink_errors}): peer traffic should use PCIe"
                    if erroring
                    else f"{util:g} % utilized (threshold {t.nvlink_utilization_pct:g} %)"
                )
                out.append(
                    LinkCongested(
                        node_id=self.node_id,
                        gpu_index=r.index,
                        link=link.link,
                        peer_gpu_index=link.peer_gpu_index,
                        utilization_pct=float(util or 0.0),
                        errors=new,
                        action="pcie_fallback" if erroring else "warn",
                        detail=f"GPU {r.index} NVLink {link.link}{peer}: {why}"[:500],
                    )
                )
            elif (
                ls.congested
                and not erroring
                and (util is None or util < t.nvlink_utilization_pct - LINK_REARM_PCT)
            ):
                ls.congested = False
        return out


def readings_of(gpus: Sequence[Any]) -> list[GpuReading]:
    """Readings from heartbeat GPUs (:class:`dsec_core.events.GpuInfo`): temperature, XIDs,
    uncorrected ECC (no throttle or link counters: those come from NVML or a script)."""
    return [
        GpuReading(
            index=g.index,
            uuid=g.uuid,
            temperature_c=g.temperature_c,
            xid_total=g.xid_errors,
            ecc_uncorrected_total=g.ecc_uncorrected,
        )
        for g in gpus
    ]
