#!/usr/bin/env bash
# Demo scene (issue 16, record/replay and A/B): two risk-agent variants compared over one
# recorded session, each trial in its own sandbox, the inputs identical by their hash.
#
#   examples/ab-experiment/demo.sh            # on a running stack (`dsec up`)
#
# What it shows:
#   1. the records service runs; the risk agent (variant a) runs once live with
#      `record: {tools: true}`: every tool call's request and answer goes into an encrypted,
#      content-addressed recording, announced by `recording.saved` (the records service is then
#      shut down: nothing live is left to ask);
#   2. `dsec experiment run` replays that recording to variants a and b, REPEATS times each,
#      in parallel, scores the trials with scorer.py and prints the table: means, 95 % CIs,
#      Welch's test per input and the paired t-test overall;
#   3. every trial_completed event carries the recording's root hash: both variants saw the
#      very same inputs (`dsec experiment show ID` recomputes the table from the events).
set -euo pipefail
cd "$(dirname "$0")/../.."
export DSEC_HOME="${DSEC_HOME:-$PWD/.dsec}"
HERE=examples/ab-experiment
REPEATS=${REPEATS:-2}

step() { printf '\n\033[1;36m== %s\033[0m\n$ %s\n' "$1" "${*:2}"; }
die() { echo "ab demo: $*" >&2; exit 1; }
jq_() {  # jq_ JSON EXPR: evaluate a Python expression over the parsed JSON `d`
  python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(eval(sys.argv[2]))' "$1" "$2"
}

step "The live records service the session asks" \
  dsec submit $HERE/records/dsec.yaml --code $HERE/records --wait ready
records=$(dsec submit $HERE/records/dsec.yaml --code $HERE/records --wait ready --stall 120 \
  --json | tail -n 1)
[ "$(jq_ "$records" 'd["state"]')" = running ] || die "the records service did not start"

step "Record one session of variant a (record: {tools: true})" \
  dsec submit $HERE/agent/record.yaml --code $HERE/agent --wait exited
session=$(dsec submit $HERE/agent/record.yaml --code $HERE/agent --wait exited --stall 120 \
  --json | tail -n 1)
SESSION=$(jq_ "$session" 'd["sandbox_id"]')
[ "$(jq_ "$session" 'd["exit_code"]')" = 0 ] || { dsec sandbox logs --stderr "$SESSION"; exit 1; }
saved=$(dsec audit replay --sandbox "$SESSION" --type recording.saved --json \
  | grep '^{' | tail -n 1)
[ -n "$saved" ] || die "no recording.saved for $SESSION"
RECORDING=$(jq_ "$saved" 'd["payload"]["recording_id"]')
echo "recording.saved: $(jq_ "$saved" 'd["payload"]')"

step "A/B: both variants replay the recording ($REPEATS trials each, 2 at once)" \
  dsec experiment run --inputs "$RECORDING" --variant a=$HERE/agent/spec_a.yaml \
  --variant b=$HERE/agent/spec_b.yaml --repeats "$REPEATS" --scorer $HERE/scorer.py
dsec experiment run --inputs "$RECORDING" --variant a=$HERE/agent/spec_a.yaml \
  --variant b=$HERE/agent/spec_b.yaml --repeats "$REPEATS" --parallel 2 \
  --scorer $HERE/scorer.py --name risk-ab

step "Identical inputs, from the log: every trial saw the recording's root hash" \
  dsec experiment ls
EXP=$(dsec experiment ls --json | python3 -c '
import json, sys
rows = [r for r in json.load(sys.stdin) if r["name"] == "risk-ab"]
print(rows[-1]["experiment_id"])')
dsec experiment show "$EXP" --json | python3 -c '
import json, sys
d = json.load(sys.stdin)
hashes = sorted({t["inputs_hash"] for t in d["trials"]})
print(len(d["trials"]), "trials; the inputs hash each saw:", hashes)
sys.exit(0 if hashes == [d["inputs_hash"]] else 1)' || die "the trials saw different inputs"
