"""The CLI's surface as a user meets it: what `dsec --help` loads (start-up), the command index
against the real commands, `--json` on every command and as errors, `--yes` on destructive
commands, `--version`, completion, and one clean error for an unreachable NATS.

Start-up time itself is measured in ``bench/cli_start.py``; here we check its cause, the set
of modules a command line imports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dsec_cli.main import COMMANDS, app
from typer import _click as click
from typer.core import TyperGroup
from typer.main import get_command
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

DSEC = str(Path(sys.executable).parent / "dsec")  # the installed entry point

#: Never imported just to show help, a version or a command's options: the bus client, the
#: event models and what they pull in, the read-model and object-store clients, YAML, the
#: libraries behind other commands.
HEAVY = (
    "nats",
    "aiohttp",
    "asyncpg",
    "minio",
    "yaml",
    "nacl",
    "msgpack",
    "pydantic_settings",
    "dsec_core.events",
    "dsec_core.envelope",
    "dsec_core.settings",
    "dsec_core.spec",
    "dsec_core.bus",
    "dsec_rules",
    "dsec_snapstore",
    "dsec_cli.stack",
    "dsec_cli.remote",
)

PROBE = """
import json, sys
sys.argv = ["dsec", *ARGS]
from dsec_cli.main import main
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def _imported_by(*args: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.replace("ARGS", repr(list(args)))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "100"},
    )
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("--version",),
        ("version",),
        ("sandbox", "list", "--help"),
        ("events", "tail", "--help"),
        ("submit", "--help"),
    ],
)
def test_common_command_lines_import_no_heavy_module(args: tuple[str, ...]) -> None:
    modules = _imported_by(*args)
    heavy = sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert heavy == [], f"`dsec {' '.join(args)}` imported {heavy}"


def test_top_level_help_imports_no_command_module() -> None:
    modules = _imported_by("--help")
    assert sorted(m for m in modules if m.startswith("dsec_cli.commands.")) == []


def _root() -> TyperGroup:
    root = get_command(app)
    assert isinstance(root, TyperGroup)
    return root


def test_the_index_names_every_command_module_with_its_real_help() -> None:
    """`dsec --help` shows the index; it must say what the commands themselves say."""
    modules = {
        p.stem
        for p in Path(__import__("dsec_cli.commands").commands.__path__[0]).glob("*.py")
        if not p.stem.startswith("_")
    }
    assert modules == {module for module, _ in COMMANDS.values()}, (
        "a command module is missing from dsec_cli.main.COMMANDS (or one listed is gone)"
    )
    root = _root()
    ctx = click.Context(root)
    for name, (_, short_help) in COMMANDS.items():
        command = root.get_command(ctx, name)
        assert command is not None, name
        assert " ".join((command.help or "").split("\n\n")[0].split()) == short_help, name


def _leaves(group: TyperGroup, ctx: Any, path: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    found = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, TyperGroup):
            found += _leaves(command, ctx, (*path, name))
        elif command is not None:
            found.append((" ".join((*path, name)), command))
    return found


#: Commands without ``--json``: none. (``sandbox logs``/``exec`` print JSON lines, ``events
#: tail`` and ``audit replay`` one object per event.)
WITHOUT_JSON: set[str] = set()

#: Destructive commands: each asks, or takes ``--yes``. Not here: ``down`` (stops this node's
#: sandboxes and servers but deletes no data, like `docker compose down`), ``sandbox stop``
#: (like `docker stop` / `kubectl delete pod`), ``node cordon`` (undone by ``uncordon``),
#: ``projections rebuild`` (rebuilt from the log), dry runs.
DESTRUCTIVE = {
    "sandbox gc",
    "snapshot rm",
    "snapshot retain",
    "snapshot gc",
    "node drain",
    "audit keys revoke",
}


def test_every_command_has_json_and_every_destructive_one_yes() -> None:
    root = _root()
    leaves = dict(_leaves(root, click.Context(root)))
    assert len(leaves) > 40  # the walk reached every group
    options = {
        path: {opt for param in command.params for opt in getattr(param, "opts", [])}
        for path, command in leaves.items()
    }
    missing = sorted(path for path, opts in options.items() if "--json" not in opts)
    assert missing == sorted(WITHOUT_JSON)
    with_yes = {path for path, opts in options.items() if "--yes" in opts}
    assert with_yes == DESTRUCTIVE


def invoke(*args: str, home: Path, stdin: str | None = None) -> Any:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("DSEC_")}
    env.update({"DSEC_HOME": str(home), "COLUMNS": "200"})
    return CliRunner().invoke(app, list(args), env=env, input=stdin, catch_exceptions=False)


@pytest.mark.parametrize(
    "args",
    [
        ("snapshot", "rm", "v1"),
        ("snapshot", "gc"),
        ("node", "drain", "node-1"),
        ("audit", "keys", "revoke", "0123456789abcdef"),
        ("sandbox", "gc", "--older-than", "0s"),
    ],
)
def test_destructive_commands_refuse_without_yes_when_nobody_can_answer(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    result = invoke(*args, home=tmp_path)  # stdin is not a terminal; nothing is running either
    assert result.exit_code == 2, result.output
    assert "without confirmation: pass --yes" in result.output
    json_result = invoke(*args, "--json", home=tmp_path)
    assert json_result.exit_code == 2
    error = json.loads(json_result.stdout)["error"]
    assert error["code"] == "bad_input" and error["exit_code"] == 2
    assert "pass --yes" in error["message"]


def test_usage_errors_are_json_with_json(tmp_path: Path) -> None:
    result = invoke("sandbox", "list", "--bogus", "--json", home=tmp_path)
    assert result.exit_code == 2
    assert json.loads(result.stdout) == {
        "error": {"code": "bad_input", "exit_code": 2, "message": "No such option: --bogus"}
    }
    plain = invoke("sandbox", "list", "--bogus", home=tmp_path)  # the flag does not stick
    assert plain.exit_code == 2 and plain.stdout == "" and "--bogus" in plain.stderr


def test_a_mistyped_command_gets_a_suggestion(tmp_path: Path) -> None:
    result = invoke("sandbx", "list", home=tmp_path)
    assert result.exit_code == 2
    assert "No such command 'sandbx'. Did you mean 'sandbox'?" in result.stderr


def test_version_names_the_packages(tmp_path: Path) -> None:
    from importlib.metadata import version

    result = invoke("version", "--json", home=tmp_path)
    assert result.exit_code == 0
    found = json.loads(result.stdout)
    assert found["dsec-cli"] == version("dsec-cli") and found["dsec-core"] == version("dsec-core")
    assert found["python"] == sys.version.split()[0]
    flag = invoke("--version", home=tmp_path)
    assert flag.exit_code == 0 and flag.stdout.startswith(f"dsec {version('dsec-cli')}\n")


def test_completion_script_for_bash() -> None:
    done = subprocess.run(
        [DSEC, "--show-completion", "bash"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "complete" in done.stdout and "_DSEC_COMPLETE" in done.stdout.upper()


def test_completion_lists_top_level_and_sub_commands() -> None:
    def complete(words: str) -> list[str]:
        env = {
            **os.environ,
            "_DSEC_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
        }
        done = subprocess.run(
            [DSEC],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
        )
        return done.stdout.split()

    assert {"sandbox", "snapshot", "submit"} <= set(complete("dsec s"))
    assert {"list", "logs", "stop"} <= set(complete("dsec sandbox "))


def _bare_dsec(args: list[str], **settings: str) -> subprocess.CompletedProcess[str]:
    """The installed ``dsec`` with no ``DSEC_*`` setting but ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    return subprocess.run(
        [DSEC, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**env, **settings},
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when we return: nothing listens


@pytest.mark.parametrize("as_json", [False, True])
def test_events_tail_with_nats_down_is_one_clean_error(as_json: bool, tmp_path: Path) -> None:
    done = _bare_dsec(
        ["events", "tail", *(["--json"] if as_json else [])],
        DSEC_HOME=str(tmp_path),
        DSEC_NATS_URL=f"nats://127.0.0.1:{_closed_port()}",
    )
    assert done.returncode == 3
    assert "Traceback" not in done.stdout + done.stderr
    if as_json:
        error = json.loads(done.stdout)["error"]
        assert error["code"] == "unreachable" and "cannot reach NATS" in error["message"]
    else:
        assert done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: cannot reach NATS at nats://")


@pytest.mark.parametrize("as_json", [False, True])
def test_a_bad_setting_read_by_any_command_is_one_clean_error(
    as_json: bool, tmp_path: Path
) -> None:
    """``snapshot gc --dry-run`` reads the settings itself, outside the stack's checks: a bad
    ``DSEC_*`` value there printed a traceback; now every command names the variable, exit 2."""
    done = _bare_dsec(
        ["snapshot", "gc", "--dry-run", *(["--json"] if as_json else [])],
        DSEC_HOME=str(tmp_path),
        DSEC_SNAPSHOT_GC_WAIT_S="soon",
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stdout + done.stderr
    said = json.loads(done.stdout)["error"]["message"] if as_json else done.stderr.strip()
    assert said.removeprefix("error: ").startswith("DSEC_SNAPSHOT_GC_WAIT_S: Input should be")


def test_spinner_only_when_both_streams_are_terminals(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from dsec_cli import common
    from rich.console import Console

    def consoles(stdout_tty: bool) -> io.StringIO:
        err = io.StringIO()
        monkeypatch.setattr(common, "err_console", Console(file=err, force_terminal=True))
        monkeypatch.setattr(
            common, "console", Console(file=io.StringIO(), force_terminal=stdout_tty)
        )
        return err

    err = consoles(stdout_tty=True)
    with common.spinner("building the environment") as show:
        show("building the environment (3 s)")
    assert "building the environment" in err.getvalue()

    err = consoles(stdout_tty=False)  # `dsec submit spec > out.txt`: nothing spins
    with common.spinner("building the environment") as show:
        show("building the environment (3 s)")
    assert err.getvalue() == ""


def test_exec_json_is_chunks_then_the_exit_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`sandbox exec --json`: what the command writes, UTF-8 decoded even when a character is
    split between two chunks, then its exit code (also dsec's)."""
    from dsec_cli import remote

    async def session(kind: str, sandbox_id: str, args: Any, write: Any, **_: Any) -> Any:
        assert kind == "exec" and args["argv"] == ["python", "-V"]
        snowman = "☃".encode()
        write("stdout", b"Python 3" + snowman[:1])
        write("stdout", snowman[1:] + b"\n")
        write("stderr", b"warn\xff")
        return type("Ended", (), {"code": 3, "reason": "exited"})()

    monkeypatch.setattr(remote, "session", session)
    result = invoke("sandbox", "exec", "--json", "sbx_1", "--", "python", "-V", home=tmp_path)
    assert result.exit_code == 3
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines == [
        {"stream": "stdout", "data": "Python 3"},
        {"stream": "stdout", "data": "☃\n"},
        {"stream": "stderr", "data": "warn\ufffd"},
        {"exit_code": 3},
    ]


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "100"},
    )


def test_the_script_ends_without_teardown_yet_with_all_its_output_and_its_status() -> None:
    """`dsec` ends by ``os._exit`` after the command (``run``): a 270 KB document written to a
    pipe arrives whole, the exit status is the command's, the ``atexit`` handlers ran."""
    script = subprocess.run(
        [DSEC, "events", "schema"], capture_output=True, text=True, timeout=120, check=False
    )
    usual = _python("from dsec_cli.main import main; main()", "events", "schema")
    assert script.returncode == usual.returncode == 0, script.stderr + usual.stderr
    assert len(script.stdout) > 100_000 and script.stdout == usual.stdout

    at_exit = (
        "import atexit, sys; atexit.register(print, 'atexit ran'); sys.argv[0] = 'dsec'\n"
        "from dsec_cli.main import run; run()"
    )
    for argv, status in ((["version", "--json"], 0), (["no-such-command"], 2)):
        done = _python(at_exit, *argv)
        assert done.returncode == status, done.stderr
        assert done.stdout.rstrip().endswith("atexit ran")
    assert json.loads(_python(at_exit, "version", "--json").stdout.splitlines()[0])["python"]


def test_the_script_waits_for_a_thread_still_running() -> None:
    """With another thread alive, ``run`` leaves by Python's own exit, which waits for it: the
    thread prints once the main thread has ended (``os._exit`` would end the process first)."""
    done = _python(
        "import sys, threading, time\n"
        "def late():\n"
        "    while threading.main_thread().is_alive(): time.sleep(0.005)\n"
        "    print('thread finished', flush=True)\n"
        "threading.Thread(target=late).start(); sys.argv[0] = 'dsec'\n"
        "from dsec_cli.main import run; run()",
        "version",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "thread finished"


def test_collection_is_paused_for_start_up_only() -> None:
    """``main`` pauses the garbage collector while a command's modules load; the command itself
    runs with it on, and what start-up made is frozen (never walked again)."""
    done = _python(
        "import gc, json, sys\n"
        "from dsec_cli import main as m\n"
        "seen = []\n"
        "load = m.LazyGroup._load\n"
        "def spy(self, name):\n"
        "    seen.append(gc.isenabled()); load(self, name); seen.append(gc.isenabled())\n"
        "m.LazyGroup._load = spy\n"
        "sys.argv[0] = 'dsec'\n"
        "try: m.main()\n"
        "except SystemExit: pass\n"
        "print(json.dumps([seen, gc.isenabled(), gc.get_freeze_count()]))",
        "events",
        "schema",
    )
    seen, enabled, frozen = json.loads(done.stdout.splitlines()[-1])
    assert seen == [False, True] and enabled and frozen > 10_000


def test_options_left_unset_build_no_pydantic_adapter() -> None:
    """Typer 0.29 builds a pydantic ``TypeAdapter`` for every option of the command that runs
    before it looks at the value; a value left unset (``None``) is never coerced, so the CLI
    defers each adapter to the first value that needs it: ``dsec version --json`` imports no
    pydantic (183 -> 119 ms on 2026-12-04)."""
    assert "pydantic" not in _imported_by("version", "--json")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("events", "tail", "-n", "1.5"), "Invalid value for '-n': Input should be a valid "
         "integer, unable to parse string as an integer"),
        (("experiment", "run", "--repeats", "x"), "Invalid value for '--repeats': Input should "
         "be a valid integer, unable to parse string as an integer"),
    ],
)  # fmt: skip
def test_a_value_given_is_coerced_and_refused_as_typer_does(
    args: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    result = invoke(*args, "--json", home=tmp_path)
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["message"] == message
