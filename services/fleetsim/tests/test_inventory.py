"""Inventories: the openb node list, YAML mixing models, flags; errors located."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec_fleetsim import inventory
from dsec_fleetsim.inventory import InventoryError, parse_csv, parse_yaml

pytestmark = pytest.mark.unit

OPENB = Path(__file__).parents[3] / "bench" / "data" / "openb" / "openb_node_list_gpu_node.csv"
HEADER = "sn,cpu_milli,memory_mib,gpu,model\n"


def test_the_openb_node_list_reads_as_1213_nodes_of_canonical_models() -> None:
    plans = inventory.load_csv(OPENB)
    assert len(plans) == 1213
    first = plans[0]
    assert (first.node_id, first.cpus, first.memory_bytes) == ("openb-node-0000", 64.0, 256 << 30)
    assert (first.gpus, first.gpu_model) == (2, "P100")
    models = {p.gpu_model for p in plans}
    assert models == {"P100", "T4", "V100M16", "V100M32", "A10", "G2", "G3"}
    assert sum(p.gpus for p in plans) == sum(
        int(line.split(",")[3]) for line in OPENB.read_text().splitlines()[1:]
    )


def test_a_csv_sn_is_sanitised_and_a_prefix_goes_before_it() -> None:
    plans = parse_csv(HEADER + "rack 1/node.a,1000,1024,1,t4\n", prefix="lab")
    assert plans[0].node_id == "lab-rack-1-node-a" and plans[0].gpu_model == "T4"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "n1,64000,1024,2,P100\nn2,lots,1024,2,P100\n",
            "f.csv:3: cpu_milli: 'lots' is not a whole",
        ),
        ("n1,64000,1024,2,Z9\n", "f.csv:2: model: unknown GPU model 'Z9'; valid: P100, T4"),
        ("n1,64000,1024,2,a100\n", "f.csv:2: model: 'a100' names several models (A100-40GB"),
        ("n1,64000,1024,2,\n", "f.csv:2: model: empty for a node with 2 GPUs"),
        ("n1,64000,1024,-1,T4\n", "f.csv:2: gpu: -1: at least 0 and at most 64"),
        ("n1,64000,1024,1,T4\nn1,64000,1024,1,T4\n", "f.csv: node id 'n1' given twice"),
        ("n1,64000\n", "f.csv:2: 2 fields, the header has 5"),
        ("", "f.csv: no nodes"),
    ],
)
def test_csv_errors_name_the_line_and_column(body: str, message: str) -> None:
    with pytest.raises(InventoryError) as err:
        parse_csv(HEADER + body, "f.csv")
    assert message in str(err.value)


def test_a_csv_without_the_openb_header_says_which_columns_are_missing() -> None:
    with pytest.raises(InventoryError, match=r"f.csv:1: missing column\(s\) memory_mib, model"):
        parse_csv("sn,cpu_milli,gpu\nn1,1,1\n", "f.csv")


YAML = """\
nodes:
  - {name: a100, count: 3, gpus: 8, gpu_model: A100-80GB, cpu: 96, memory: 1TiB}
  - {name: h100, count: 2, gpus: 8, gpu_model: h100-sxm, labels: {zone: b}}
  - {name: big-1, gpus: 8, gpu_model: MI300X, cpu: 500m, memory: 2TiB}
  - {name: cpu, count: 1}
"""


def test_a_yaml_inventory_mixes_models() -> None:
    plans = parse_yaml(YAML, "inv.yaml", prefix="sim")
    ids = [p.node_id for p in plans]
    assert ids == [
        "sim-a100-0", "sim-a100-1", "sim-a100-2", "sim-h100-0", "sim-h100-1", "sim-big-1",
        "sim-cpu",
    ]  # fmt: skip
    by_id = {p.node_id: p for p in plans}
    assert by_id["sim-a100-0"].gpu_model == "A100-80GB" and by_id["sim-a100-0"].cpus == 96
    assert by_id["sim-h100-1"].gpu_model == "H100" and by_id["sim-h100-1"].labels == {"zone": "b"}
    assert by_id["sim-big-1"].gpu_model == "MI300X" and by_id["sim-big-1"].cpus == 0.5
    assert by_id["sim-big-1"].gpu_memory_bytes == 192 << 30
    assert by_id["sim-cpu"].gpus == 0 and by_id["sim-cpu"].gpu_model is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes:\n  - {gpus: 8, gpu_model: B200}\n", "inv.yaml: nodes[0].gpu_model: unknown GPU"),
        ("nodes:\n  - {gpus: 8}\n  - {gpus: 99}\n", "inv.yaml: nodes[1].gpus: Input should be"),
        ("nodes:\n  - {gpu: 8}\n", "inv.yaml: nodes[0].gpu: Extra inputs are not permitted"),
        ("nodes:\n  - {memory: lots}\n", "inv.yaml: nodes[0].memory:"),
        ("nodes:\n  - {gpu_model: H100}\n", "nodes[0].gpu_model: given without gpus"),
        ("nodes:\n  - {name: 'a b'}\n", "nodes[0].name: Value error, letters, digits"),
        ("nodes:\n  - {labels: {'-x': a}}\n", "nodes[0].labels: Value error, key '-x': 1-63"),
        ("nodes: [\n", "inv.yaml: not valid YAML"),
        ("- 1\n", "inv.yaml: expected a mapping with nodes"),
        ("nodes:\n  - {name: x}\n  - {name: x}\n", "inv.yaml: node id 'sim-x' given twice"),
    ],
)
def test_yaml_errors_name_the_entry_and_field(text: str, message: str) -> None:
    with pytest.raises(InventoryError) as err:
        parse_yaml(text, "inv.yaml")
    assert message in str(err.value)


def test_flags_make_identical_nodes_and_refuse_a_family() -> None:
    plans = inventory.uniform(3, gpus=8, gpu_model="h100")
    assert [p.node_id for p in plans] == ["sim-0", "sim-1", "sim-2"]
    assert {p.gpu_model for p in plans} == {"H100"}
    with pytest.raises(InventoryError, match="--gpu-model: 'a100' names several models"):
        inventory.uniform(1, gpus=8, gpu_model="a100")
    with pytest.raises(InventoryError, match="--nodes 0: between 1 and 100000"):
        inventory.uniform(0)


def test_labels_from_flags_follow_the_node_agents_rules() -> None:
    from dsec_fleetsim.main import parser, plans_of

    args = parser().parse_args(["--nodes", "2", "--label", "zone=a", "--label", "sim=true"])
    assert plans_of(args)[1].labels == {"zone": "a", "sim": "true"}
    bad = parser().parse_args(["--nodes", "2", "--label", "zone=a b"])
    with pytest.raises(InventoryError, match=r"--label 'zone=a b': value of 'zone'"):
        plans_of(bad)
