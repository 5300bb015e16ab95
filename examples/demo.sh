#!/usr/bin/env bash
# The DSec demo, end to end on the embedded stack. Run it with `./taskw demo`.
# Each step says what a user would type; expected failures (a rejected spec, a conflict) are
# part of the story and checked, not ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
export DSEC_HOME="${DSEC_HOME:-$PWD/.dsec}"

step() { printf '\n\033[1;36m== %s\033[0m\n$ %s\n' "$1" "${*:2}"; }
expect() {  # expect CODE CMD...: run CMD, fail the demo unless it exits with CODE
  local want=$1; shift
  set +e; "$@"; local got=$?; set -e
  if [ "$got" -ne "$want" ]; then
    echo "demo: expected exit $want from '$*', got $got" >&2; exit 1
  fi
}

jq_() {  # jq_ JSON EXPR: evaluate a Python expression over the parsed JSON `d`
  python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(eval(sys.argv[2]))' "$1" "$2"
}

trap 'echo; echo "demo failed; the stack is still up for inspection: dsec status, dsec down" >&2' ERR

step "A small world on loopback: DNS for websearch.test, its HTTPS search API, a tracker" \
  python -m dsec_testing.demo_world --dir "\$DSEC_HOME/demo-world"
WORLD="$DSEC_HOME/demo-world"
mkdir -p "$DSEC_HOME"
python -m dsec_testing.demo_world --dir "$WORLD" --dns-port 5354 --max-seconds 1800 \
  > "$DSEC_HOME/demo-world.log" 2>&1 &
WORLD_PID=$!
for _ in $(seq 100); do [ -f "$WORLD/world.json" ] && break; sleep 0.1; done
[ -f "$WORLD/world.json" ] || { cat "$DSEC_HOME/demo-world.log"; exit 1; }
export DSEC_DNS_UPSTREAM=127.0.0.1:5354   # the node agent's DNS proxy asks this resolver
export DSEC_DNS_TRUSTED_TARGETS=127.0.0.53  # the world's API lives on loopback: let DNS open it

step "Start the embedded stack" dsec up
dsec up
python -m dsec_testing.demo_world seed --dir "$WORLD"   # the API key into OpenBao, data into S3

step "What runs" dsec status
dsec status

step "A spec with mistakes: every error at once, at its line" dsec spec check examples/bad-spec/dsec.yaml
expect 2 dsec spec check examples/bad-spec/dsec.yaml

step "Another tenant's secret and data, the system bucket, the stack's NATS, a /0 split in two, the host's /etc: refused" \
  dsec spec check examples/cross-tenant/dsec.yaml
expect 2 dsec spec check examples/cross-tenant/dsec.yaml

step "Which grants does the agent code need?" dsec policy infer --code examples/websearch-agent
dsec policy infer --code examples/websearch-agent

step "Submitting the broken spec: the policy service rejects it" \
  dsec submit examples/bad-spec/dsec.yaml --wait validated
expect 1 dsec submit examples/bad-spec/dsec.yaml --wait validated

step "The brief's spec: vllm 0.6.1 needs newer transformers — blocked with alternatives" \
  dsec submit examples/brief/dsec.yaml --wait built
expect 1 dsec submit examples/brief/dsec.yaml --wait built --stall 120

step "The web-search agent: secret from OpenBao, data from S3, one API allowed by name" \
  dsec submit examples/websearch-agent/dsec.yaml --code examples/websearch-agent
dsec submit examples/websearch-agent/dsec.yaml --code examples/websearch-agent --stall 120 \
  | tee "$DSEC_HOME/websearch-submit.log"
SEARCH_SID=$(grep -o 'sbx_[0-9a-f]*' "$DSEC_HOME/websearch-submit.log" | head -n 1)
echo "--- what the agent printed:"
dsec sandbox logs "$SEARCH_SID"

step "Tools at run time: the search API stalls, rate limits and refuses the key; the agent's
  calls are retried, fall back to local_search, and the node agent says why (tool.degraded) and
  when it heals (tool.recovered)" bash examples/flaky-search/demo.sh
WORLD="$WORLD" bash examples/flaky-search/demo.sh

step "Two agents call each other's tools over shared memory (same task group)" \
  dsec submit examples/two-agents/researcher/dsec.yaml --code examples/two-agents/researcher --wait ready
researcher_json=$(dsec submit examples/two-agents/researcher/dsec.yaml \
  --code examples/two-agents/researcher --wait ready --stall 120 --json | tail -n 1)
RESEARCHER=$(jq_ "$researcher_json" 'd["sandbox_id"]')
planner_json=$(dsec submit examples/two-agents/planner/dsec.yaml \
  --code examples/two-agents/planner --wait exited --stall 120 --json | tail -n 1)
PLANNER=$(jq_ "$planner_json" 'd["sandbox_id"]')
[ "$(jq_ "$planner_json" 'd["exit_code"]')" = 0 ] || { dsec sandbox logs --stderr "$PLANNER"; exit 1; }
echo "--- the planner (its calls to the researcher, p50/p99 in µs):"
dsec sandbox logs "$PLANNER"
echo "--- the researcher (ends when the planner asks it to):"
dsec sandbox logs --follow "$RESEARCHER"

step "A long-running evaluation agent" \
  dsec submit examples/eval-agent/dsec.yaml --code examples/eval-agent --wait ready --json
ready_json=$(dsec submit examples/eval-agent/dsec.yaml --code examples/eval-agent --wait ready \
  --stall 120 --json | tail -n 1)
SID=$(jq_ "$ready_json" 'd["sandbox_id"]')
CODE_DIR=$(jq_ "$ready_json" '[e for e in d["events"] if e["type"]=="sandbox.ready"][0]["payload"]["code_dir"]')
echo "sandbox $SID runs; its code copy on this node: $CODE_DIR"

step "Snapshot it while it runs" dsec snapshot create "$SID" --name eval-good
dsec snapshot create "$SID" --name eval-good-$SID
dsec snapshot inspect eval-good-$SID

step "Yesterday 0.92, today 0.87: run the snapshot with changed code — refused, line by line" \
  dsec sandbox run --snapshot eval-good --code CHANGED
changed=$(mktemp -d); cp -r examples/eval-agent/. "$changed"
sed -i 's/0.92/0.87/' "$changed/config.txt"
expect 1 dsec sandbox run --snapshot eval-good-$SID --code "$changed"
rm -rf "$changed"

step "A bad hot-patch reaches the running sandbox; roll it back to the snapshot" \
  dsec sandbox rollback "$SID" --to eval-good
sed -i 's/0.92/0.87/' "$CODE_DIR/config.txt"
sleep 1; dsec sandbox logs "$SID" | tail -n 2
dsec sandbox rollback "$SID" --to eval-good-$SID
sleep 1; dsec sandbox logs "$SID" | tail -n 2
dsec sandbox logs "$SID" | tail -n 1 | grep -q "threshold 0.92" \
  || { echo "demo: the rollback did not restore the running sandbox" >&2; exit 1; }
dsec sandbox stop "$SID"

step "Sandboxes, from the Postgres read models" dsec sandbox list
for _ in $(seq 50); do  # the projector follows the log asynchronously
  dsec sandbox list --json | python3 -c 'import json,sys; sys.exit(0 if len(json.load(sys.stdin))>=3 else 1)' && break
  sleep 0.1
done
dsec sandbox list

step "Refusals, with the rule that refused them (and what the sandbox's semantic layer reported)" \
  dsec audit replay --type policy.violation --type policy.violation_summary --type policy.reported
dsec audit replay --type policy.violation --type policy.violation_summary --type policy.reported \
  --sandbox "$SEARCH_SID"
echo "--- the world saw (no question about tracker, no tracker connection):"
cat "$DSEC_HOME/demo-world.log"

step "The brief's task topology: three GPU units placed as one gang on a simulated fleet of
A100-80GB, H100 and MI300X nodes (each simulated node signs as its own certified node agent)" \
  dsec fleet simulate --inventory examples/rag-training/fleet.yaml '&' \
  dsec submit examples/rag-training/dsec.yaml '&&' dsec schedule explain SANDBOX
dsec spec check examples/rag-training/dsec.yaml
dsec fleet simulate --inventory examples/rag-training/fleet.yaml --for 120 --json \
  > "$DSEC_HOME/fleet-sim.log" 2>&1 &
FLEET_PID=$!
for _ in $(seq 150); do  # the simulated nodes join; the read model follows the log
  SIM_READY=$(dsec node ls --json | python3 -c 'import json,sys
print(sum(n["state"] == "ready" and n["node_id"].startswith("sim-") for n in json.load(sys.stdin)))')
  [ "$SIM_READY" -ge 14 ] && break
  sleep 0.2
done
[ "$SIM_READY" -ge 14 ] || { echo "demo: the simulated fleet did not join ($SIM_READY)" >&2; exit 1; }
RAG_SID=$(dsec submit examples/rag-training/dsec.yaml --code examples/rag-training --wait ready --json \
  | tail -n 1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["sandbox_id"])')
COLUMNS=160 dsec schedule explain "$RAG_SID"
dsec schedule explain "$RAG_SID" --json | tail -n 1 | python3 -c 'import json,sys
d = json.load(sys.stdin); sys.exit(0 if d["decision"] == "placed" and len(d["units"]) == 3 else 1)' \
  || { echo "demo: the gang was not placed" >&2; exit 1; }
dsec sandbox stop "$RAG_SID"
kill "$FLEET_PID" 2>/dev/null || true
wait "$FLEET_PID" 2>/dev/null || true

step "A GPU heats past 85 °C on a simulated fleet: the scheduler moves its unit to another node
  (the simulated nodes model the CRIU move and measure the interruption)" \
  dsec fleet simulate --inventory examples/gpu-migration/fleet.yaml --prefix mig --script examples/gpu-migration/heat.yaml '&' \
  dsec unit migrations --sandbox SANDBOX
dsec fleet simulate --inventory examples/gpu-migration/fleet.yaml --prefix mig \
  --script examples/gpu-migration/heat.yaml --heartbeat-s 1 --for 150 --json \
  > "$DSEC_HOME/fleet-mig.log" 2>&1 &
MIG_FLEET_PID=$!
for _ in $(seq 150); do  # the three simulated nodes join
  MIG_READY=$(dsec node ls --json | python3 -c 'import json,sys
print(sum(n["state"] == "ready" and n["node_id"].startswith("mig-") for n in json.load(sys.stdin)))')
  [ "$MIG_READY" -ge 3 ] && break
  sleep 0.2
done
[ "$MIG_READY" -ge 3 ] || { echo "demo: the simulated fleet did not join ($MIG_READY)" >&2; exit 1; }
# stand-in for the fleet's own health threshold: publishes gpu.degraded, signed as the node
DSEC_NATS_NKEY_SEED="$DSEC_HOME/nats/fleetsim.nk" python examples/gpu-migration/watch_heat.py mig- 120 \
  > "$DSEC_HOME/heat.log" 2>&1 &
HEAT_PID=$!
MIG_SID=$(dsec submit examples/gpu-migration/dsec.yaml --code examples/gpu-migration --wait ready --json \
  | tail -n 1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["sandbox_id"])')
MIG_NODE=$(dsec schedule explain "$MIG_SID" --json | tail -n 1 | python3 -c 'import json,sys
print(json.load(sys.stdin)["units"][0]["node_id"])')
if [ "$MIG_NODE" != mig-h100-0 ]; then  # the GPU that heats is mig-h100-0's: the operator moves it there
  dsec unit migrate "$MIG_SID" --to mig-h100-0 --wait
fi
wait "$HEAT_PID" || { echo "demo: no GPU passed 85 °C: $(cat "$DSEC_HOME/heat.log")" >&2; exit 1; }
cat "$DSEC_HOME/heat.log"
for _ in $(seq 150); do  # the scheduler moves the unit; the target's node agent reports it
  dsec unit migrations --sandbox "$MIG_SID" --json | python3 -c 'import json,sys
sys.exit(0 if any(r["reason"] == "gpu_degraded" and r["outcome"] == "migrated" for r in json.load(sys.stdin)) else 1)' && break
  sleep 0.2
done
COLUMNS=160 dsec unit migrations --sandbox "$MIG_SID"
dsec unit migrations --sandbox "$MIG_SID" --json | python3 -c 'import json,sys
r = [r for r in json.load(sys.stdin) if r["reason"] == "gpu_degraded"][-1]
assert r["outcome"] == "migrated" and r["from_node"] == "mig-h100-0", r
print("unit %s moved %s -> %s by %s: interrupted %.1f ms"
      % (r["unit"], r["from_node"], r["to_node"], r["path"], r["interruption_ms"]))' \
  || { echo "demo: the unit on the hot GPU did not move" >&2; exit 1; }
dsec sandbox stop "$MIG_SID"
kill "$MIG_FLEET_PID" 2>/dev/null || true
wait "$MIG_FLEET_PID" 2>/dev/null || true

step "Agent state: a stateful agent survives SIGKILL with every acknowledged message, then is
  upgraded to v2 by a live hand-over while another agent keeps calling it" \
  bash examples/stateful-agent/demo.sh
bash examples/stateful-agent/demo.sh

step "A/B over a recorded session: two agent variants replay the same recorded tool calls, each
  trial in its own sandbox; means, confidence intervals and a t-test" \
  bash examples/ab-experiment/demo.sh
bash examples/ab-experiment/demo.sh

step "Prove the whole log: every signature, chain link and sequence" dsec audit verify
dsec audit verify

step "Two more nodes on this machine: three NATS servers in one JetStream cluster (the log on all
three), a node agent each (a home of its own: a home's log stays on the servers that wrote it)" \
  dsec down '&&' DSEC_HOME=\$DSEC_HOME/three-nodes dsec up --nodes 3
dsec down > /dev/null 2>&1
ONE_NODE_HOME="$DSEC_HOME"
export DSEC_HOME="$ONE_NODE_HOME/three-nodes"
dsec up --nodes 3 > /dev/null
dsec status   # nats, nats-2, nats-3; nodeagent, nodeagent@node-2, nodeagent@node-3

step "The nodes, as their heartbeats describe them" dsec node ls --json
READY=0
for _ in $(seq 100); do  # each node agent joins and heartbeats; the read model follows the log
  READY=$(dsec node ls --json | python3 -c 'import json,sys
print(sum(n["state"] == "ready" for n in json.load(sys.stdin)))')
  [ "$READY" -ge 3 ] && break
  sleep 0.2
done
dsec node ls --json
[ "$READY" -ge 3 ] || { echo "demo: not three ready nodes ($READY)" >&2; exit 1; }

step "Stop everything" dsec down
dsec down
export DSEC_HOME="$ONE_NODE_HOME"
kill "$WORLD_PID" 2>/dev/null || true
wait "$WORLD_PID" 2>/dev/null || true
trap - ERR
echo; echo "demo complete"
