"""The placement engine as the scheduler and the benchmark use it: filters, GPU shares, whole
GPUs, gangs (all or none), NVLink colocation, no-fit reasons with counts, commit / release,
and that a seed makes a run reproducible."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from dsec_scheduler.placement import frag
from dsec_scheduler.placement.api import (
    Edge,
    GangDemand,
    GangPlacement,
    GpuSpec,
    NodeSpec,
    Unfit,
    UnitChoice,
    UnitDemand,
)
from dsec_scheduler.placement.engine import POLICIES, Engine

pytestmark = pytest.mark.unit

GIB = 1 << 30


def node(
    name: str,
    n: int = 8,
    model: str = "A100-80GB",
    *,
    cpu: int = 64_000,
    mem: int = 512 * GIB,
    gpu_mem: int = 80 * GIB,
    groups: int = 1,
    temp: float | None = None,
    healthy: bool = True,
    **kw: object,
) -> NodeSpec:
    gpus = tuple(
        GpuSpec(
            index=i,
            model=model,
            memory_bytes=gpu_mem,
            nvlink_group=i * groups // max(n, 1),
            healthy=healthy,
            temperature_c=temp,
        )
        for i in range(n)
    )
    return NodeSpec(node_id=name, cpu_milli=cpu, memory_bytes=mem, gpus=gpus, **kw)  # type: ignore[arg-type]


def unit(key: str, **kw: object) -> UnitDemand:
    kw.setdefault("cpu_milli", 1000)
    kw.setdefault("memory_bytes", GIB)
    return UnitDemand(key=key, **kw)  # type: ignore[arg-type]


def gang(*units: UnitDemand, edges: tuple[Edge, ...] = (), gid: str = "") -> GangDemand:
    return GangDemand(gid or units[0].key, units, edges)


def engine(policy: str = "dsec", *nodes: NodeSpec, seed: int = 0) -> Engine:
    e = Engine(policy, seed=seed)
    for n in nodes:
        e.upsert_node(n)
    return e


def placed(e: Engine, g: GangDemand) -> GangPlacement:
    got = e.place(g)
    assert isinstance(got, GangPlacement), got
    e.commit(got)
    return got


@pytest.mark.parametrize("policy", POLICIES)
def test_shares_stack_on_one_gpu_up_to_1000_milli(policy: str) -> None:
    e = engine(policy, node("n1", 1))
    for i, m in enumerate((400, 350, 250)):
        got = placed(e, gang(unit(f"u{i}", gpu_milli=m)))
        assert got.choices[0].gpu_indices == (0,) and got.choices[0].gpu_milli == m
    assert e.allocation_ratio()["all"] == pytest.approx(1.0)
    full = e.place(gang(unit("more", gpu_milli=1)))
    assert isinstance(full, Unfit)
    assert full.reasons == {"insufficient GPU share": 1}


@pytest.mark.parametrize("policy", POLICIES)
def test_whole_gpus_take_free_gpus_only(policy: str) -> None:
    e = engine(policy, node("n1", 4))
    placed(e, gang(unit("share", gpu_milli=100)))
    got = placed(e, gang(unit("three", gpus=3)))
    (c,) = got.choices
    assert len(c.gpu_indices) == 3 and c.gpu_milli == 1000
    taken_by_share = set(range(4)) - set(c.gpu_indices)
    assert len(taken_by_share) == 1
    again = e.place(gang(unit("one", gpus=1)))
    assert isinstance(again, Unfit)
    assert again.reasons == {"insufficient whole GPUs": 1}


def test_model_memory_and_temperature_filters_with_reason_counts() -> None:
    e = engine(
        "dsec",
        node("a100-1", 8, "A100-80GB"),
        node("a100-2", 8, "A100-40GB", gpu_mem=40 * GIB),
        node("v100-1", 8, "V100-32GB", gpu_mem=32 * GIB),
        node("hot", 8, "A100-80GB", temp=91.0),
        node("cordoned", 8, "A100-80GB", schedulable=False, unschedulable_reason="cordoned"),
        node("small-cpu", 8, "A100-80GB", cpu=500),
    )
    u = unit(
        "u",
        gpus=1,
        models=frozenset({"A100-80GB", "A100-40GB"}),
        min_gpu_memory_bytes=60 * GIB,
        max_temperature_c=85.0,
    )
    got = e.place(gang(u))
    assert isinstance(got, GangPlacement)
    assert got.choices[0].node_id == "a100-1"
    assert got.choices[0].feasible_nodes == 1
    e.upsert_node(node("a100-1", 8, "A100-80GB", temp=90.0))  # heats up
    no = e.place(gang(u))
    assert isinstance(no, Unfit)
    assert no.unit == "u" and no.nodes_total == 6
    assert no.reasons == {
        "cordoned": 1,
        "no GPU of model A100-40GB/A100-80GB": 1,
        "no GPU with 60 GiB memory": 1,
        "GPU too hot": 2,
        "insufficient CPU": 1,
    }
    assert no.summary().startswith("0/6 nodes: 2 GPU too hot, 1 cordoned")


def test_unhealthy_gpus_and_memory_and_unit_limit() -> None:
    e = engine(
        "fgd",
        node("sick", 2, healthy=False),
        node("tiny-mem", 2, mem=GIB // 2),
        node("busy", 2, max_units=0),
    )
    no = e.place(gang(unit("u", gpu_milli=500)))
    assert isinstance(no, Unfit)
    assert no.reasons == {"GPU unhealthy": 1, "insufficient memory": 1, "at its unit limit": 1}


def test_gang_is_all_or_none_and_rolls_back() -> None:
    e = engine("dsec", node("n1", 2), node("n2", 2))
    ok = e.place(gang(unit("a", gpus=2), unit("b", gpus=2), gid="g1"))
    assert isinstance(ok, GangPlacement)
    assert {c.node_id for c in ok.choices} == {"n1", "n2"}
    assert e.allocation_ratio()["all"] == 0.0  # place() changes nothing
    # three units of two GPUs on four GPUs: none is taken, and the engine is unchanged after
    no = e.place(gang(unit("x", gpus=2), unit("y", gpus=2), unit("z", gpus=2), gid="g2"))
    assert isinstance(no, Unfit)
    assert no.reasons == {"insufficient whole GPUs": 2}
    assert e.allocation_ratio()["all"] == 0.0
    e.commit(ok)
    assert e.allocation_ratio()["all"] == 1.0


def test_gang_places_the_most_constrained_unit_first() -> None:
    e = engine("dsec", node("big", 8), node("small", 1))
    got = e.place(gang(unit("share", gpu_milli=500), unit("eight", gpus=8), gid="g"))
    assert isinstance(got, GangPlacement)
    by = {c.key: c for c in got.choices}
    assert by["eight"].node_id == "big"
    assert by["share"].node_id == "small"
    assert [c.key for c in got.choices] == ["share", "eight"]  # in the gang's order


def test_nvlink_edge_keeps_units_on_one_node_and_one_nvlink_group() -> None:
    e = engine("dsec", node("n1", 8, groups=2), node("n2", 8, groups=2))
    placed(e, gang(unit("pad", gpus=2)))  # n? now has 2 GPUs of group 0 taken
    g = gang(
        unit("a", gpus=2),
        unit("b", gpus=2),
        edges=(Edge("a", "b", "nvlink-p2p"),),
        gid="pair",
    )
    for _ in range(2):
        got = placed(
            e,
            g
            if _ == 0
            else gang(
                *(unit(k + "2", gpus=2) for k in "ab"),
                edges=(Edge("a2", "b2", "nvlink-p2p"),),
                gid="p2",
            ),
        )
        a, b = got.choices
        assert a.node_id == b.node_id
        groups = {i // 4 for i in a.gpu_indices + b.gpu_indices}
        assert len(groups) == 1
    roce = placed(
        e,
        gang(
            unit("r1", gpus=1),
            unit("r2", gpus=1),
            edges=(Edge("r1", "r2", "rdma-over-converged-ethernet"),),
            gid="roce",
        ),
    )
    assert len(roce.choices) == 2


def test_shm_edge_that_cannot_colocate_is_unfit_with_peer_reason() -> None:
    e = engine("bestfit", node("n1", 1), node("n2", 1))
    no = e.place(
        gang(unit("a", gpus=1), unit("b", gpus=1), edges=(Edge("a", "b", "shm"),), gid="g")
    )
    assert isinstance(no, Unfit)
    assert no.reasons == {"not the node of its nvlink/shm peer": 1, "insufficient whole GPUs": 1}


def test_commit_and_release_give_capacity_back() -> None:
    e = engine("dsec", node("n1", 2, cpu=4000))
    got = placed(e, gang(unit("u1", gpus=2, cpu_milli=4000)))
    assert e.allocation_ratio() == {"A100-80GB": 1.0, "all": 1.0}
    assert isinstance(e.place(gang(unit("u2", cpu_milli=1))), Unfit)
    with pytest.raises(ValueError, match="already holds"):
        e.commit(got)
    e.release("u1")
    e.release("u1")  # no-op
    assert e.allocation_ratio()["all"] == 0.0
    assert isinstance(e.place(gang(unit("u2", gpus=2, cpu_milli=4000))), GangPlacement)


def test_upsert_keeps_what_units_hold_and_remove_forgets_the_node() -> None:
    e = engine("dsec", node("n1", 2))
    placed(e, gang(unit("u", gpus=1)))
    e.upsert_node(node("n1", 2, temp=40.0))  # a heartbeat
    assert e.allocation_ratio()["all"] == 0.5
    e.remove_node("n1")
    assert list(e.nodes()) == []
    e.upsert_node(node("n2", 2))
    assert e.allocation_ratio()["all"] == 0.0


def test_breakdown_names_the_score_terms() -> None:
    e = engine("dsec", node("n1", 8))
    got = e.place(gang(unit("u", gpu_milli=300)))
    assert isinstance(got, GangPlacement)
    assert set(got.choices[0].breakdown) == {"fragmentation_delta", "fgd_score", "node_used_after"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gpu_milli": 1500}, "gpu_milli 1500 is not 0-1000"),
        ({"gpus": -1}, "gpus -1 is negative"),
        ({"gpus": 1, "gpu_milli": 500}, "gpus and gpu_milli are exclusive"),
        ({"cpu_milli": -5}, "cpu_milli, memory_bytes, min_gpu_memory_bytes must be ≥ 0"),
    ],
)
def test_a_bad_unit_is_a_clear_error(fields: dict[str, int], message: str) -> None:
    e = engine("dsec", node("n1", 1))
    with pytest.raises(ValueError, match=f"gang g, unit u: {message}"):
        e.place(gang(unit("u", **fields), gid="g"))


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="random, bestfit, fgd, dsec"):
        Engine("greedy")


def _run(policy: str, seed: int) -> list[tuple[str, tuple[int, ...]]]:
    rng = random.Random(5)
    e = engine(policy, *(node(f"n{i:02d}", rng.choice((1, 2, 4, 8))) for i in range(20)), seed=seed)
    out = []
    for i in range(120):
        u = unit(
            f"u{i}",
            **rng.choice(
                ({"gpu_milli": rng.randrange(100, 1000, 50)}, {"gpus": rng.choice((1, 2))})
            ),
        )
        got = e.place(gang(u))
        if isinstance(got, GangPlacement):
            e.commit(got)
            out.append((got.choices[0].node_id, got.choices[0].gpu_indices))
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_a_seed_makes_a_run_reproducible(policy: str) -> None:
    assert _run(policy, 1) == _run(policy, 1)


def test_random_policy_differs_between_seeds() -> None:
    assert _run("random", 1) != _run("random", 2)


def test_fragmentation_measure_matches_its_definition() -> None:
    """ΔF from the vectorised form equals F(after) − F(before) computed plainly."""
    import numpy as np

    counts = {
        (1000, 0, 500, frozenset(), 0): 5.0,
        (2000, 1, 0, frozenset(), 0): 3.0,
        (500, 0, 0, frozenset(), 0): 1.0,
        (8000, 2, 0, frozenset({"A"}), 0): 2.0,
        (300, 0, 250, frozenset(), 0): 4.0,
    }
    typ = frag.typical_from_counts(counts.items(), {"A": 0, "B": 1}, 2, 1.0)

    def plain(g: list[int], model: str, cpu: int) -> float:
        tot, out = sum(g), 0.0
        for (c, n, m, models), w in zip(typ.keys, typ.weight, strict=True):
            need, count = (1000, n) if n else (m, 1 if m else 0)
            usable = need > 0 and (not models or model in models)
            if usable and sum(x >= need for x in g) >= count and cpu >= c:
                out += w * sum(x for x in g if x < need)
            else:
                out += w * tot
        return out

    rng = random.Random(1)
    free = np.array([[rng.choice((0, 250, 500, 750, 1000)) for _ in range(4)] for _ in range(40)])
    gm = np.array([[rng.choice((0, 1))] * 4 for _ in range(40)])
    cpu = np.array([rng.choice((0, 500, 1000, 3000, 9000)) for _ in range(40)])
    d, _ = frag.share_candidates(typ, free, gm, np.ones_like(free, bool), cpu, 300, 250)
    for r in range(40):
        for j in range(4):
            if free[r, j] >= 250:
                g = [int(x) for x in free[r]]
                after = g.copy()
                after[j] -= 250
                m = "AB"[gm[r, 0]]
                want = plain(after, m, int(cpu[r]) - 300) - plain(g, m, int(cpu[r]))
                assert d[r, j] == pytest.approx(want)


@pytest.mark.parametrize("policy", ["fgd", "dsec"])
def test_the_distribution_is_learned_online(policy: str) -> None:
    """Without a given distribution, the units asked for teach it (a pending gang asked again
    counts once): once whole-GPU units are typical, a share goes onto the GPU that is already
    used rather than breaking a whole one, even though that node comes second by name."""
    e = Engine(policy)
    e.upsert_node(node("n1", 1))
    e.upsert_node(node("n2", 1))
    for i in range(40):  # asked for, never committed: they only teach the distribution
        e.place(gang(unit(f"w{i}", gpus=1), gid=f"w{i}"))
        e.place(gang(unit(f"w{i}", gpus=1), gid=f"w{i}"))
    shapes = {k[:3] for k in e._typical().keys}
    assert shapes == {(1000, 1, 0)}
    # a share already holds 700 milli of n2's GPU (committed as the scheduler would)
    e.commit(
        GangPlacement(
            "u",
            (UnitChoice("used", "n2", (0,), 700, cpu_milli=1000, memory_bytes=GIB),),
            policy,
            3,
        )
    )
    got = e.place(gang(unit("share", gpu_milli=300), gid="s"))
    assert isinstance(got, GangPlacement)
    assert got.choices[0].node_id == "n2"
    assert got.choices[0].breakdown["fgd_score"] > 50  # the fragment gets used
    fresh = engine(policy, node("n1", 1), node("n2", 1))  # nothing learned yet: ties by name
    one = fresh.place(gang(unit("share", gpu_milli=300), gid="s"))
    assert isinstance(one, GangPlacement) and one.choices[0].node_id == "n1"


def test_bench_harness_smoke_on_a_30_node_slice(tmp_path: Path) -> None:
    """The openb harness end to end on a slice (the real runs live in bench/, not here)."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[3]
    data = root / "bench" / "data" / "openb"
    nodes = tmp_path / "nodes.csv"
    lines = (data / "openb_node_list_gpu_node.csv").read_text().splitlines(True)
    nodes.write_text("".join(lines[:31]))
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "".join((data / "openb_pod_list_default.csv").read_text().splitlines(True)[:201])
    )
    out = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "placement.py"),
            "--nodes-csv",
            str(nodes),
            "--pods-csv",
            str(pods),
            "--seeds",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=True,
    )
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["trace"] == "pods"
    assert set(last["policies"]) == set(POLICIES)
    for v in last["policies"].values():
        assert 50 < v["alloc_at_130"] <= 100 and v["std"] >= 0
    assert last["decisions_per_s"] > 0 and last["decision_p99_ms"] > 0
    assert "trace pods (2 seeds)" in out.stderr
