"""Health scripts: steps, their order, errors located."""

from __future__ import annotations

import pytest

from dsec_fleetsim.script import ScriptError, parse_script

pytestmark = pytest.mark.unit

IDS = ["sim-0", "sim-1", "sim-10", "sim-2"]


def test_steps_are_sorted_and_globs_name_nodes() -> None:
    steps = parse_script(
        """\
steps:
  - {at: 60, node: sim-2, crash: true}
  - {at: 30, node: sim-0, gpu: 2, temperature: 92, over: 30}
  - {at: 45, node: "sim-1*", gpu: all, xid: 79}
  - {at: 120, node: sim-2, recover: true}
""",
        "s.yaml",
        IDS,
    )
    assert [(s.at, s.action) for s in steps] == [
        (30, "temperature"), (45, "xid"), (60, "crash"), (120, "recover"),
    ]  # fmt: skip
    assert steps[1].nodes(IDS) == ["sim-1", "sim-10"]
    assert steps[0].over == 30 and steps[0].gpu == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("steps:\n  - {at: 1, node: sim-0, crash: true, recover: true}\n",
         "s.yaml: steps[0]: Value error, exactly one action of temperature, xid, crash, recover"),
        ("steps:\n  - {at: 1, node: sim-0, xid: 79}\n", "steps[0]: Value error, xid needs gpu"),
        ("steps:\n  - {at: -1, node: sim-0, crash: true}\n", "steps[0].at: Input should be"),
        ("steps:\n  - {at: 1, node: sim-9, crash: true}\n",
         "s.yaml: steps[0].node: 'sim-9' names no node"),
        ("steps:\n  - {at: 1, node: sim-0, heat: 3}\n", "steps[0].heat: Extra inputs"),
        ("steps: {\n", "s.yaml: not valid YAML"),
    ],
)  # fmt: skip
def test_script_errors_name_the_step_and_field(text: str, message: str) -> None:
    with pytest.raises(ScriptError) as err:
        parse_script(text, "s.yaml", IDS)
    assert message in str(err.value)
