"""GPU health judged from readings: thresholds, hysteresis, link congestion, the operator's
cluster config (pure)."""

from __future__ import annotations

import pytest
from dsec_core.events import GpuDegraded, GpuRecovered, LinkCongested
from dsec_core.gpuhealth import (
    ClusterConfig,
    ConfigError,
    GpuReading,
    HealthTracker,
    LinkReading,
    Thresholds,
    parse_value,
    throttle_names,
)

pytestmark = pytest.mark.unit


def _hot(c: float, index: int = 0) -> GpuReading:
    return GpuReading(index=index, uuid=f"GPU-{index}", temperature_c=c, xid_total=0)


def _types(out: list[object]) -> list[str]:
    return [type(e).__name__ for e in out]


def test_temperature_degrades_at_the_threshold_and_recovers_only_below_the_margin() -> None:
    t = HealthTracker("n1", thresholds=Thresholds(temperature_c=85, recover_margin_c=5))
    assert t.observe(0, [_hot(84.9)]) == []
    (degraded,) = t.observe(1, [_hot(92)])
    assert isinstance(degraded, GpuDegraded)
    assert (degraded.node_id, degraded.gpu_index, degraded.gpu_uuid) == ("n1", 0, "GPU-0")
    assert (degraded.signal, degraded.value, degraded.threshold) == ("temperature", 92, 85)
    assert degraded.detail == "GPU 0 at 92 °C (threshold 85 °C)"
    assert t.observe(2, [_hot(95)]) == []  # still degraded: said once
    assert t.observe(3, [_hot(82)]) == []  # under the threshold, not under the margin
    assert t.degraded() == {0: ("temperature",)}
    (recovered,) = t.observe(13, [_hot(80)])
    assert isinstance(recovered, GpuRecovered)
    assert (recovered.gpu_index, recovered.degraded_s) == (0, 12.0)
    assert t.degraded() == {}


def test_an_xid_burst_degrades_and_clears_after_a_quiet_period() -> None:
    t = HealthTracker("n1", "simulated", Thresholds(xid_errors=2, recover_after_s=30))
    r = lambda x: GpuReading(index=3, uuid="GPU-3", xid_total=x)  # noqa: E731
    assert t.observe(0, [r(0)]) == []
    assert t.observe(1, [r(1)]) == []  # one new XID: under a threshold of 2
    (d,) = t.observe(2, [r(4)])
    assert isinstance(d, GpuDegraded)
    assert (d.signal, d.value, d.source, d.severity) == ("xid", 3, "simulated", "critical")
    assert t.observe(20, [r(4)]) == []  # quiet, but not for 30 s yet
    (rec,) = t.observe(32, [r(4)])
    assert isinstance(rec, GpuRecovered) and rec.degraded_s == 30


def test_each_new_signal_is_said_and_recovery_waits_for_the_last() -> None:
    t = HealthTracker("n1", thresholds=Thresholds(recover_after_s=10))
    base = dict(index=0, uuid="GPU-0", xid_total=0, ecc_uncorrected_total=0)
    out = t.observe(0, [GpuReading(**base, temperature_c=90)])  # type: ignore[arg-type]
    out += t.observe(
        1, [GpuReading(**base, temperature_c=90, throttle=frozenset({"hw_thermal", "gpu_idle"}))]
    )  # type: ignore[arg-type]
    assert [(e.signal, e.severity) for e in out if isinstance(e, GpuDegraded)] == [
        ("temperature", "critical"), ("throttle", "warning"),
    ]  # fmt: skip
    assert t.observe(2, [GpuReading(**base, temperature_c=70)]) == []  # type: ignore[arg-type]
    assert _types(t.observe(11, [GpuReading(**base, temperature_c=70)])) == ["GpuRecovered"]  # type: ignore[arg-type]


def test_a_gpu_that_vanishes_is_degraded_lost() -> None:
    t = HealthTracker("n1", thresholds=Thresholds(recover_after_s=0))
    t.observe(0, [_hot(40), _hot(40, 1)])
    (d,) = t.observe(1, [_hot(40)])
    assert isinstance(d, GpuDegraded) and (d.gpu_index, d.signal, d.gpu_uuid) == (
        1,
        "lost",
        "GPU-1",
    )
    assert _types(t.observe(2, [_hot(40), _hot(40, 1)])) == ["GpuRecovered"]


def test_links_congest_on_load_or_errors_and_rearm_below() -> None:
    t = HealthTracker("n1", thresholds=Thresholds(nvlink_utilization_pct=90, nvlink_errors=100))
    g = lambda util, errs: GpuReading(  # noqa: E731
        index=0,
        links=(LinkReading(link=2, peer_gpu_index=1, utilization_pct=util, errors_total=errs),),
    )
    assert t.observe(0, [g(50, 1000)]) == []  # errors since start are not new
    (c,) = t.observe(1, [g(95, 1000)])
    assert isinstance(c, LinkCongested)
    assert (c.link, c.peer_gpu_index, c.action, c.utilization_pct) == (2, 1, "warn", 95)
    assert t.observe(2, [g(85, 1000)]) == []  # still within 10 points: not re-armed
    assert t.observe(3, [g(70, 1000)]) == []  # re-armed
    (e,) = t.observe(4, [g(10, 1500)])
    assert isinstance(e, LinkCongested) and (e.action, e.errors) == ("pcie_fallback", 500)
    assert "peer traffic should use PCIe" in e.detail


def test_a_zero_threshold_turns_a_signal_off_and_a_spec_only_tightens() -> None:
    t = HealthTracker("n1", thresholds=Thresholds(xid_errors=0))
    assert t.observe(0, [GpuReading(index=0, xid_total=50)]) == []
    op = Thresholds(temperature_c=85, xid_errors=0, nvlink_errors=100)
    tight = op.strictest({"temperature_c": 80, "xid_errors": 3, "nvlink_errors": 500})
    assert (tight.temperature_c, tight.xid_errors, tight.nvlink_errors) == (80, 3, 100)
    assert op.strictest({"temperature_c": 95}).temperature_c == 85


def test_throttle_mask_names() -> None:
    assert throttle_names(0x40 | 0x1) == frozenset({"hw_thermal", "gpu_idle"})


def test_cluster_config_values_are_checked_and_canonical() -> None:
    assert parse_value("gpu.temperature_c", "90.0") == "90"
    assert parse_value("gpu.mig", "TRUE") == "on"
    assert parse_value("gpu.throttle", "hw_thermal, sw_thermal") == "hw_thermal,sw_thermal"
    with pytest.raises(
        ConfigError, match=r"gpu.temperature_c: '200' is out of range; valid: 30 to 110"
    ):
        parse_value("gpu.temperature_c", "200")
    with pytest.raises(ConfigError, match=r"unknown key 'gpu.temp'; valid: gpu.temperature_c"):
        parse_value("gpu.temp", "1")
    with pytest.raises(ConfigError, match=r"unknown throttle reason 'hot'"):
        parse_value("gpu.throttle", "hot")
    config = ClusterConfig.of({"gpu.temperature_c": "90", "gpu.future": "x", "gpu.mig": "maybe"})
    assert config.values == {"gpu.temperature_c": "90"}
    assert config.thresholds().temperature_c == 90 and config.get("gpu.mig") is False
    assert config.with_value("gpu.mig", "on").effective()["gpu.mig"] == ("on", True)
