"""Agent processes for the broker hand-over test (test_ipc_handover.py).

``python _handover_agents.py server|aserver SOCKET NAME LOGFILE``: serves ``record`` (appends the
call's seq to LOGFILE, returns who served it) with ``serve()`` or ``aserve()``, with a stand-in
for its ``AgentState`` attached (``DSecClient.attach_state``): SIGUSR1 plays the keeper's
``handover`` (the state's hand-over callbacks run in a thread, as the SDK's do: serving pauses),
then it creates LOGFILE + ".paused"; with ``$DSEC_STATE_HANDOVER_FROM`` set it is a hand-over's
new version, and the client's ``ready()`` creates LOGFILE + ".ready". ``$DSEC_TEST_BALLAST_MIB``:
memory it touches first (a large agent).

``python _handover_agents.py caller SOCKET MODE OUTFILE STOPFILE``: calls ``record`` in a loop
(MODE ``sync``: one at a time; ``threads``: three threads on one client; ``async``: four in
flight) until STOPFILE exists, then writes
``{"answers": [[seq, who]...], "errors": [str...]}`` to OUTFILE.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from dsec_sdk import DSecClient

GROUP = "g1"
NAME = "agent-b"


class StandInState:
    """What ``DSecClient`` uses of an ``AgentState`` in a hand-over."""

    def __init__(self, logfile: str) -> None:
        self.logfile = logfile
        self.handover = bool(os.environ.get("DSEC_STATE_HANDOVER_FROM"))
        self.switched = None
        self.callbacks: list[Any] = []

    def on_handover(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def ready(self) -> None:
        Path(self.logfile + ".ready").touch()

    def hand_over(self) -> None:
        def run() -> None:
            for callback in self.callbacks:
                if callback() is False:
                    return
            Path(self.logfile + ".paused").touch()

        threading.Thread(target=run, daemon=True).start()


def serve(socket_path: str, who: str, logfile: str, *, in_loop: bool = False) -> None:
    # A large agent (bench/migration.py): memory touched first, so that its death takes long.
    ballast = bytearray(int(os.environ.get("DSEC_TEST_BALLAST_MIB") or 0) << 20)
    for page in range(0, len(ballast), 4096):
        ballast[page] = 1
    client = DSecClient(NAME, GROUP, socket_path=socket_path)
    state = StandInState(logfile)
    client.attach_state(state)
    log = open(logfile, "a", buffering=1)  # noqa: SIM115 - the process's lifetime

    def record(seq: int) -> dict[str, Any]:
        log.write(f"{seq}\n")
        return {"seq": seq, "who": who}

    def ping() -> str:
        return "pong"

    if not in_loop:
        signal.signal(signal.SIGUSR1, lambda *_: state.hand_over())
        client.serve({"record": record, "ping": ping})
        return

    async def aserve() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, state.hand_over)
        await client.aserve({"record": record, "ping": ping})

    asyncio.run(aserve())


def call(socket_path: str, mode: str, outfile: str, stopfile: str) -> None:
    client = DSecClient("agent-a", GROUP, socket_path=socket_path, timeout=60)
    answers: list[tuple[int, str]] = []
    errors: list[str] = []
    stop = Path(stopfile)
    if mode == "sync":
        seq = 0
        while not stop.exists():
            try:
                answer = client.call_tool(NAME, "record", seq=seq)
                answers.append((answer["seq"], answer["who"]))
            except Exception as exc:
                errors.append(f"{seq}: {type(exc).__name__}: {exc}")
            seq += 1
    elif mode == "threads":  # three threads sharing the client (and its channel)
        counter = iter(range(1 << 62))
        lock = threading.Lock()

        def work() -> None:
            while not stop.exists():
                with lock:
                    seq = next(counter)
                try:
                    answer = client.call_tool(NAME, "record", seq=seq)
                    answers.append((answer["seq"], answer["who"]))
                except Exception as exc:
                    errors.append(f"{seq}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=work) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:

        async def run() -> None:
            counter = iter(range(1 << 62))

            async def worker() -> None:
                while not stop.exists():
                    seq = next(counter)
                    try:
                        answer = await client.acall_tool(NAME, "record", seq=seq)
                        answers.append((answer["seq"], answer["who"]))
                    except Exception as exc:
                        errors.append(f"{seq}: {type(exc).__name__}: {exc}")

            await asyncio.gather(*(worker() for _ in range(4)))

        asyncio.run(run())
    tmp = outfile + ".tmp"
    Path(tmp).write_text(json.dumps({"answers": answers, "errors": errors}))
    os.replace(tmp, outfile)
    client.close()


if __name__ == "__main__":
    if sys.argv[1] in ("server", "aserver"):
        serve(sys.argv[2], sys.argv[3], sys.argv[4], in_loop=sys.argv[1] == "aserver")
    else:
        call(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
