# mypy: ignore-errors
# Test fixture: analysed statically by dsec_rules.infer, never imported or run.
"""AutoGen idioms, subprocesses and files (test fixture)."""

import subprocess
from pathlib import Path

from autogen import register_function
from autogen_core.tools import FunctionTool

OUT = Path("/workspace/output")


def calc(expression: str) -> str:
    return str(subprocess.run(["python3", "-c", f"print({expression})"], capture_output=True))


def report(rows: list[str]) -> None:
    with open("/data/input.csv") as fh:
        rows += fh.read().splitlines()
    (OUT / "report.md").write_text("\n".join(rows))
    with open(f"/var/cache/agent/{len(rows)}.json", "w") as fh:
        fh.write("{}")
    subprocess.check_call("git status --short", shell=True)


register_function(calc, caller=None, executor=None, name="calculator", description="Math")
report_tool = FunctionTool(report, description="Write the report")
