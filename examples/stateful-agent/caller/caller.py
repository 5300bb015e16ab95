"""The caller: chats with the stateful agent in a loop and checks that nothing answered is lost.

Every ``chat`` carries a message id; an answered chat is *acknowledged*: the agent checkpointed
it before answering. The caller checks, all the way through:

- the turn count never goes back (an answer's ``turns`` is at least the previous answer's + 2);
- after an outage (the agent was SIGKILLed and restarted), the agent still has every
  acknowledged message (``missing(ids)`` is empty);
- when the version changes (a hand-over to v2), the same, and v2 says its history is complete.

It prints one JSON line per thing worth seeing (``start``, ``error``, ``back``, ``version``,
``progress``, ``summary``) and keeps going through errors (a call that failed is sent again: it
was not acknowledged). It ends after :data:`AFTER_V2` chats with v2 (then asks the agent to shut
down) or after :data:`MAX_SECONDS`. Exit 0 when nothing acknowledged was lost and v2 answered.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from dsec_sdk import AgentNotFound, DSecClient, IpcError

PEER = os.environ.get("STATEFUL_AGENT", "stateful-agent")
MAX_SECONDS = float(os.environ.get("CALLER_MAX_SECONDS", "600"))
PACE_S = 0.02  # ~50 chats a second at most
AFTER_V2 = 200
PROGRESS_EVERY = 100


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": round(time.time(), 3), **fields}), flush=True)


def main() -> int:
    client = DSecClient(timeout=30.0)
    say("start", caller=client.agent, group=client.group, peer=PEER)
    acked: list[str] = []
    errors: list[dict[str, Any]] = []
    lost: list[str] = []
    turns = 0
    version: str | None = None
    in_outage = False
    regressions = 0
    v2_calls = 0
    latencies: list[float] = []
    n = 0
    started = time.monotonic()
    while time.monotonic() - started < MAX_SECONDS and v2_calls < AFTER_V2:
        msg_id = f"m-{n:06d}"
        t0 = time.perf_counter()
        try:
            answer = client.call_tool(PEER, "chat", message=f"hello number {n}", id=msg_id)
        except IpcError as exc:
            if isinstance(exc, AgentNotFound) and version is None:
                time.sleep(0.1)  # not serving yet: the agent is still starting
                continue
            errors.append({"n": n, "type": type(exc).__name__, "version": version})
            if not in_outage:  # the first error of an outage (the rest are counted)
                say("error", n=n, type=type(exc).__name__, detail=str(exc)[:200], version=version)
            in_outage = True
            time.sleep(0.1)
            continue  # not acknowledged: send it again
        ms = (time.perf_counter() - t0) * 1000
        latencies.append(ms)
        if answer["turns"] < turns + 2:
            say("regressed", n=n, turns=answer["turns"], previous=turns)
            regressions += 1
        turns = answer["turns"]
        acked.append(msg_id)
        n += 1
        changed = version is not None and answer["version"] != version
        if in_outage or changed:
            gone = client.call_tool(PEER, "missing", ids=acked)["missing"]
            lost.extend(gone)
            say(
                "version" if changed else "back",
                version=answer["version"],
                previous=version,
                turns=turns,
                acknowledged=len(acked),
                missing=len(gone),
                complete=answer.get("complete"),
                call_ms=round(ms, 2),
                errors_so_far=len(errors),
            )
            in_outage = False
        version = answer["version"]
        if version == "v2":
            v2_calls += 1
        if n % PROGRESS_EVERY == 0:
            say(
                "progress",
                acknowledged=len(acked),
                turns=turns,
                version=version,
                errors=len(errors),
            )
        time.sleep(PACE_S)
    final_missing: list[str] = []
    try:
        final_missing = client.call_tool(PEER, "missing", ids=acked)["missing"]
        client.call_tool(PEER, "shutdown", timeout=5.0)
    except IpcError as exc:
        say("error", n=n, type=type(exc).__name__, detail=str(exc)[:200], version=version)
        errors.append({"n": n, "type": type(exc).__name__, "version": version})
    latencies.sort()
    say(
        "summary",
        acknowledged=len(acked),
        turns=turns,
        version=version,
        errors=len(errors),
        errors_by_version={
            str(v): sum(e["version"] == v for e in errors) for v in {e["version"] for e in errors}
        },
        lost=len(set(lost) | set(final_missing)),
        regressions=regressions,
        p50_ms=round(latencies[len(latencies) // 2], 2) if latencies else None,
        max_ms=round(latencies[-1], 2) if latencies else None,
    )
    client.close()
    ok = version == "v2" and not lost and not final_missing and not regressions
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
