"""``dsec sandbox gc`` as a user runs it on a node: ended sandboxes' directories go, running
ones stay (root: real sandboxes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parents[1] / "services" / "nodeagent" / "tests"))
from _dsec_sandbox_testkit import managed, run_to_end, snippet_config


def _dsec(home: Path, *args: str) -> tuple[int, str]:
    from dsec_cli.main import app

    result = CliRunner().invoke(app, list(args), env={"DSEC_HOME": str(home)})
    return result.exit_code, result.output


@pytest.mark.kernel
async def test_gc_removes_ended_sandboxes_and_never_a_running_one(tmp_path: Path) -> None:
    home = tmp_path / "home"
    async with managed(home) as manager:
        ended = await run_to_end(
            manager,
            snippet_config("done1", "open('/workspace/output/r', 'w').write('x')", tmp_path),
        )
        assert ended.exit_code == 0
        mark = json.loads((home / "sandboxes" / "done1" / "ended.json").read_text())
        assert mark["reason"] == "ok"
        await manager.launch(snippet_config("busy", "import time; time.sleep(30)", tmp_path))

        code, out = _dsec(home, "sandbox", "gc", "--older-than", "0s", "--dry-run", "--json")
        assert code == 0, out
        assert [r["sandbox_id"] for r in json.loads(out)["removed"]] == ["done1"]
        assert (home / "sandboxes" / "done1").is_dir()  # a dry run removes nothing

        code, out = _dsec(home, "sandbox", "gc", "--older-than", "0s", "--yes", "--json")
        assert code == 0, out
        removed = json.loads(out)["removed"]
        assert [r["sandbox_id"] for r in removed] == ["done1"] and removed[0]["bytes"] > 0
        assert not (home / "sandboxes" / "done1").exists()
        assert (home / "sandboxes" / "busy" / "logs").is_dir()  # running: untouched
        await manager.stop("busy", grace_s=0.5)

        code, out = _dsec(home, "sandbox", "gc", "--older-than", "1d", "--yes")
        assert code == 0 and "removed 0 ended sandbox(es)" in out


@pytest.mark.unit
def test_gc_names_a_bad_duration(tmp_path: Path) -> None:
    code, out = _dsec(tmp_path, "sandbox", "gc", "--older-than", "soon", "--dry-run")
    assert code == 2 and "--older-than 'soon'" in out and "1d" in out
