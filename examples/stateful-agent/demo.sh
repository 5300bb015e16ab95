#!/usr/bin/env bash
# Demo scene (issue 14, the state plane): a stateful agent survives SIGKILL with every acknowledged
# message, then is upgraded to v2 by a live hand-over while another agent keeps calling its tool.
#
#   examples/stateful-agent/demo.sh            # on a running stack (`dsec up`), else it starts one
#
# What it shows, step by step:
#   1. the agent (examples/stateful-agent) and a caller (caller/) start in one task group; the
#      caller chats; every answered chat was checkpointed first (acknowledged);
#   2. the agent's main process is SIGKILLed; the node agent restarts the sandbox in place
#      (`sandbox.restarted`), the SDK restores its state (`state.recovered`), and the caller finds
#      every acknowledged message back (`missing` is empty, the turn count never went back);
#   3. `dsec sandbox upgrade ID --code examples/stateful-agent/v2` while the caller keeps calling:
#      v2 receives v1's state, takes over the tool name (`state.handed_over{interruption_ms}`),
#      proves it has the whole history, and the caller saw no error during the hand-over.
set -euo pipefail
cd "$(dirname "$0")/../.."
export DSEC_HOME="${DSEC_HOME:-$PWD/.dsec}"
HERE=examples/stateful-agent
CHATS_BEFORE_KILL=${CHATS_BEFORE_KILL:-150}
WAIT_S=${WAIT_S:-120}

step() { printf '\n\033[1;36m== %s\033[0m\n$ %s\n' "$1" "${*:2}"; }
die() { echo "stateful demo: $*" >&2; exit 1; }
jq_() {  # jq_ JSON EXPR: evaluate a Python expression over the parsed JSON `d`
  python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(eval(sys.argv[2]))' "$1" "$2"
}
now() { python3 -c 'import time; print(f"{time.time():.3f}")'; }

# event SANDBOX TYPE [AFTER_SEQ]: the first TYPE event of SANDBOX after stream seq AFTER_SEQ, as
# JSON, waiting up to WAIT_S (the read path: `dsec audit replay`, which ends, polled)
event() {
  local sid=$1 type=$2 after=${3:-0} deadline=$((SECONDS + WAIT_S)) found
  while [ "$SECONDS" -lt "$deadline" ]; do
    found=$(dsec audit replay --sandbox "$sid" --type "$type" --json 2>/dev/null | python3 -c '
import json, sys
after = int(sys.argv[1])
for line in sys.stdin:
    line = line.strip()
    if line.startswith("{"):
        e = json.loads(line)
        if e.get("seq", 0) > after:
            print(json.dumps(e)); break' "$after") || true
    [ -n "$found" ] && { echo "$found"; return 0; }
    sleep 1
  done
  die "no $type event of $sid within ${WAIT_S}s"
}

# caller_events [TYPE]: the caller's JSON lines so far (of one event type)
caller_events() {
  dsec sandbox logs "$CALLER" 2>/dev/null | python3 -c '
import json, sys
want = sys.argv[1] if len(sys.argv) > 1 else None
for line in sys.stdin:
    line = line.strip()
    if line.startswith("{"):
        e = json.loads(line)
        if want is None or e["event"] == want:
            print(json.dumps(e))' "$@"
}

# wait_caller EXPR: until the Python expression over `e` (the caller's latest matching line,
# decoded) holds; prints that line
wait_caller() {
  local type=$1 expr=$2 deadline=$((SECONDS + WAIT_S)) line
  while [ "$SECONDS" -lt "$deadline" ]; do
    line=$(caller_events "$type" | tail -n 1)
    if [ -n "$line" ] && python3 -c 'import json,sys; e=json.loads(sys.argv[1]); sys.exit(0 if eval(sys.argv[2]) else 1)' "$line" "$expr"; then
      echo "$line"; return 0
    fi
    sleep 1
  done
  die "the caller did not report $type with $expr within ${WAIT_S}s (its log: dsec sandbox logs $CALLER)"
}

STARTED_STACK=0
if ! dsec status > /dev/null 2>&1; then
  step "Start the embedded stack" dsec up
  dsec up
  STARTED_STACK=1
fi

step "The stateful agent's spec: checkpoints every second, history hot, adapter warm, restart on failure" \
  dsec spec check $HERE/dsec.yaml --code $HERE
dsec spec check $HERE/dsec.yaml --code $HERE
dsec spec check $HERE/caller/dsec.yaml --code $HERE/caller > /dev/null

step "Start the agent (v1), then its caller (same task group: it calls the tool chat)" \
  dsec submit $HERE/dsec.yaml --code $HERE --wait ready '&&' \
  dsec submit $HERE/caller/dsec.yaml --code $HERE/caller --wait ready
agent_json=$(dsec submit $HERE/dsec.yaml --code $HERE --wait ready --stall 120 --json | tail -n 1)
SID=$(jq_ "$agent_json" 'd["sandbox_id"]')
INIT_PID=$(jq_ "$agent_json" '[e for e in d["events"] if e["type"]=="sandbox.ready"][0]["payload"]["pid"]')
caller_json=$(dsec submit $HERE/caller/dsec.yaml --code $HERE/caller --wait ready --stall 120 --json | tail -n 1)
CALLER=$(jq_ "$caller_json" 'd["sandbox_id"]')
echo "agent $SID (sandbox init pid $INIT_PID), caller $CALLER"

step "The caller chats; every answer comes after a checkpoint (acknowledged)" \
  dsec sandbox logs "$CALLER"
progress=$(wait_caller progress "e['acknowledged'] >= $CHATS_BEFORE_KILL")
echo "caller: $progress"
echo "--- the agent's last checkpoints (state.checkpointed: bytes of deltas, the agent's pause):"
dsec audit replay --sandbox "$SID" --type state.checkpointed | tail -n 3

# The agent's main process: the child of the sandbox's init (pid 1 of its pid namespace).
AGENT_PID=$(pgrep -P "$INIT_PID" | head -n 1 || true)
[ -n "$AGENT_PID" ] || AGENT_PID=$INIT_PID
step "SIGKILL the agent's main process (no warning, no chance to save anything)" kill -KILL "$AGENT_PID"
before=$(caller_events progress | tail -n 1)
LAST_SEQ=$(dsec audit replay --sandbox "$SID" --json | python3 -c '
import json, sys
print(max([json.loads(l)["seq"] for l in sys.stdin if l.startswith("{")] or [0]))')
kill -KILL "$AGENT_PID"
echo "killed $AGENT_PID; the caller had: $before"

step "The node agent restarts it in place; the SDK restores its state" \
  dsec audit replay --sandbox "$SID" --type sandbox.restarted --type state.recovered
restarted=$(event "$SID" sandbox.restarted "$LAST_SEQ")
echo "sandbox.restarted: $(jq_ "$restarted" 'd["payload"]')"
recovered=$(event "$SID" state.recovered "$(jq_ "$restarted" 'd["seq"]')")
echo "state.recovered:   $(jq_ "$recovered" 'd["payload"]')"
back=$(wait_caller back "e['version'] == 'v1'")
echo "caller: $back"
[ "$(jq_ "$back" 'd["missing"]')" = 0 ] || die "acknowledged messages were lost: $back"
echo "every acknowledged message is back: $(jq_ "$back" 'd["acknowledged"]') acknowledged, $(jq_ "$back" 'd["turns"]') turns"
echo "--- the agent's log after the restart:"
dsec sandbox logs "$SID" | tail -n 2

step "Upgrade to v2 by hand-over while the caller keeps calling" \
  dsec sandbox upgrade "$SID" --code $HERE/v2
UPGRADE_T=$(now)
# It follows the new sandbox to state.handed_over; with --json its last line is the outcome:
# {sandbox_id, state: "handed_over", interruption_ms, deltas_streamed, ...}
upgrade_out=$(dsec sandbox upgrade "$SID" --code $HERE/v2 --json | tail -n 1) || true
case "$upgrade_out" in
  "{"*) [ "$(jq_ "$upgrade_out" 'd["state"]')" = handed_over ] || die "not handed over: $upgrade_out" ;;
  *) die "dsec sandbox upgrade gave no outcome: $upgrade_out" ;;
esac
NEW=$(jq_ "$upgrade_out" 'd["sandbox_id"]')
echo "$SID -> $NEW: interruption $(jq_ "$upgrade_out" 'd["interruption_ms"]') ms (v1 stops taking calls -> v2 serving), $(jq_ "$upgrade_out" 'd["deltas_streamed"]') state records streamed"
handed=$(event "$NEW" state.handed_over)
echo "state.handed_over: $(jq_ "$handed" 'd["payload"]')"
switched=$(wait_caller version "e['version'] == 'v2'")
echo "caller: $switched"
[ "$(jq_ "$switched" 'd["missing"]')" = 0 ] || die "v2 lacks acknowledged messages: $switched"
[ "$(jq_ "$switched" 'd["complete"]')" = True ] || die "v2 says its history is not complete"
echo "the call that crossed the hand-over took $(jq_ "$switched" 'd["call_ms"]') ms"
echo "--- v2's log:"
dsec sandbox logs "$NEW" | head -n 3

step "The caller ends after 200 chats with v2 (and shuts the agent down); its verdict" \
  dsec sandbox logs --follow "$CALLER"
dsec sandbox logs --follow "$CALLER" > /dev/null 2>&1 || true
summary=$(caller_events summary | tail -n 1)
echo "caller: $summary"
handover_errors=$(caller_events error | python3 -c '
import json, sys
t = float(sys.argv[1])
print(sum(json.loads(l)["t"] >= t for l in sys.stdin if l.strip()))' "$UPGRADE_T")
echo "caller errors during the hand-over: $handover_errors (during the SIGKILL outage: expected, and retried)"
[ "$handover_errors" = 0 ] || { caller_events error | tail -n 5; die "the caller saw errors during the hand-over"; }
[ "$(jq_ "$summary" 'd["lost"]')" = 0 ] || die "acknowledged messages were lost"
dsec audit replay --sandbox "$SID" --type sandbox.exited

if [ "$STARTED_STACK" = 1 ]; then
  step "Stop the stack" dsec down
  dsec down
fi
echo; echo "stateful-agent scene complete"
