"""How ``dsec snapshot rm`` / ``gc`` / ``retain`` read the snapshot service's ``snapshot.deleted``
(the answer stubbed: the service's side is tested in services/snapshot and tests/)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from dsec_cli.commands import snapshot as snapshot_cmd
from dsec_cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

runner = CliRunner()


def answered(monkeypatch: pytest.MonkeyPatch, **payload: Any) -> None:
    body = {"names": [], "missing": [], "chunks_removed": 0, "bytes_freed": 0, **payload}
    monkeypatch.setattr(
        snapshot_cmd,
        "ask_delete",
        lambda *a, **k: SimpleNamespace(type="snapshot.deleted", payload=body),
    )


def flat(text: str) -> str:
    return " ".join(text.split())


def rm_with_gc(monkeypatch: pytest.MonkeyPatch, **payload: Any) -> tuple[int, str]:
    """``dsec snapshot rm`` of the answer's names (all three kinds) with ``--gc``: its exit
    code and its output on one line."""
    answered(monkeypatch, **payload)
    asked = [*payload.get("names", []), *payload.get("missing", []), *payload.get("failed", [])]
    result = runner.invoke(app, ["snapshot", "rm", *asked, "--gc", "--yes"])
    return result.exit_code, flat(result.output)


@pytest.mark.parametrize(
    ("payload", "code", "said"),
    [
        ({"gc_grace_s": 3600.0}, 0, "freed 0 objects"),
        ({"gc_skipped": "busy"}, 1, "the store was busy"),
        ({"gc_skipped": "unreadable"}, 1, "does not check, so nothing was deleted"),
        ({"gc_skipped": "gave_up"}, 3, "gave up after its retries"),
        ({}, 1, "did not say it collected"),  # a service before 1.2
    ],
)
def test_gc_exits_by_what_the_service_says(
    monkeypatch: pytest.MonkeyPatch, payload: dict[str, Any], code: int, said: str
) -> None:
    answered(monkeypatch, **payload)
    result = runner.invoke(app, ["snapshot", "gc", "--yes"])
    assert result.exit_code == code, result.output
    assert said in flat(result.output)


def test_rm_names_what_the_service_gave_up_on_and_exits_3(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, text = rm_with_gc(monkeypatch, names=["a"], failed=["b"], gc_skipped="gave_up")
    assert code == 3, text
    assert "deleted a" in text and "b was not deleted" in text
    assert "no snapshot named b" not in text  # it may exist still: not "missing"


def test_rm_with_a_missing_name_exits_2_even_when_the_gc_did_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, text = rm_with_gc(monkeypatch, names=["a"], missing=["z"], gc_skipped="busy")
    assert code == 2, text
    assert "no snapshot named z" in text and "the store was busy" in text


def test_retain_exits_3_when_the_service_gave_up_on_some(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answered(monkeypatch, names=["old-1"], failed=["old-2"])

    class Store:
        def __enter__(self) -> Store:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def apply_retention(self, *_: object, **__: object) -> list[str]:
            return ["old-1", "old-2"]

    monkeypatch.setattr(snapshot_cmd, "snapshot_store", Store)
    result = runner.invoke(app, ["snapshot", "retain", "--keep-last", "1", "--yes", "--json"])
    assert result.exit_code == 3, result.output
    assert json.loads(result.output) == {
        "deleted": ["old-1"],
        "failed": ["old-2"],
        "dry_run": False,
    }


def test_retain_with_a_bad_policy_is_bad_input_before_any_store_is_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_store() -> None:
        raise AssertionError("the store was opened for a policy that cannot be applied")

    monkeypatch.setattr(snapshot_cmd, "snapshot_store", no_store)
    result = runner.invoke(app, ["snapshot", "retain", "--keep-last", "0", "--yes"])
    assert result.exit_code == 2, result.output
    assert "keep_last=0: must be at least 1" in flat(result.output)


def test_rm_and_retain_of_more_names_than_one_request_takes_ask_in_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One request deletes at most 1,000 snapshots (the service refuses more): `rm` and
    `retain` of more ask in batches, collecting with the last; the answers read as one."""
    asked: list[tuple[int, bool]] = []

    def ask(names: list[str], *, collect: bool, **kwargs: Any) -> Any:
        asked.append((len(names), collect))
        body = {"names": names[1:], "missing": names[:1], "chunks_removed": len(asked)}
        return SimpleNamespace(type="snapshot.deleted", payload=body)

    monkeypatch.setattr(snapshot_cmd, "ask_delete", ask)
    names = [f"snap-{i}" for i in range(2_500)]
    result = runner.invoke(app, ["snapshot", "rm", *names, "--gc", "--yes", "--json"])
    assert asked == [(1000, False), (1000, False), (500, True)]
    out = json.loads(result.output)
    assert out["missing"] == ["snap-0", "snap-1000", "snap-2000"]
    assert len(out["names"]) == 2_497 and out["chunks_removed"] == 3
