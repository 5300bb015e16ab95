#!/usr/bin/env bash
# Demo scene (issue 16, tools at run time): the web-search agent against a flaky search API.
#
#   examples/flaky-search/demo.sh      # on a running stack with the demo world (examples/demo.sh
#                                      # starts both; WORLD=DIR names another world directory)
#
# What it shows, step by step:
#   1. the world's search API is told to stall once, rate limit once (429, Retry-After: 1) and
#      then refuse the key three times (401 "API key expired");
#   2. the agent (examples/flaky-search) asks web_search 14 times through dsec_sdk.tools: the
#      stall is retried after a 1 s timeout, the 429 after its Retry-After; the 401s are not
#      retried (auth) and local_search answers instead; after 3 failures the breaker opens and
#      calls go straight to local_search until a trial call (every 3 s) gets through again;
#   3. the node agent, from the SDK's call reports, published tool.degraded (class auth, the
#      diagnosis naming WEB_SEARCH_KEY's lease, fallback local_search) and tool.recovered;
#   4. the stack's Prometheus shows dsec_tool_* by tool and failure class (the DSec tools
#      dashboard, deploy/grafana/dsec-tools.json, has a row per tool family).
set -euo pipefail
cd "$(dirname "$0")/../.."
export DSEC_HOME="${DSEC_HOME:-$PWD/.dsec}"
WORLD="${WORLD:-$DSEC_HOME/demo-world}"
HERE=examples/flaky-search
WAIT_S=${WAIT_S:-60}

step() { printf '\n\033[1;36m== %s\033[0m\n$ %s\n' "$1" "${*:2}"; }
die() { echo "flaky-search demo: $*" >&2; exit 1; }
jq_() {  # jq_ JSON EXPR: evaluate a Python expression over the parsed JSON `d`
  python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(eval(sys.argv[2]))' "$1" "$2"
}

[ -f "$WORLD/world.json" ] || die "no demo world in $WORLD (examples/demo.sh starts one)"

step "The search API stalls once, rate limits once, then refuses the key three times" \
  python -m dsec_testing.demo_world faults --dir "$WORLD" timeout 429 401x3
python -m dsec_testing.demo_world faults --dir "$WORLD" timeout 429 401x3

step "The agent asks web_search 14 times; the spec's tools: section says how it fails over" \
  dsec submit $HERE/dsec.yaml --code $HERE --wait exited
result=$(dsec submit $HERE/dsec.yaml --code $HERE --wait exited --stall 120 --json | tail -n 1)
SID=$(jq_ "$result" 'd["sandbox_id"]')
dsec sandbox logs "$SID"
[ "$(jq_ "$result" 'd["exit_code"]')" = 0 ] || { dsec sandbox logs --stderr "$SID"; die "the agent failed"; }

step "The node agent's verdict: tool.degraded with a diagnosis, then tool.recovered" \
  dsec audit replay --sandbox "$SID" --type tool.degraded --type tool.recovered
found=""
for _ in $(seq "$WAIT_S"); do  # the read path follows the log
  found=$(dsec audit replay --sandbox "$SID" --type tool.degraded --type tool.recovered --json \
    | python3 -c '
import json, sys
seen = [json.loads(l) for l in sys.stdin if l.strip().startswith("{")]
types = [e["type"] for e in seen]
if "tool.degraded" in types and "tool.recovered" in types:
    for e in seen:
        p = e["payload"]
        tool = p["tool"]
        if e["type"] == "tool.degraded":
            cls, status, fallback, reason = p["failure_class"], p["status"], p["fallback"], p["reason"]
            print(f"tool.degraded  {tool} ({cls}, HTTP {status}), fallback {fallback}:")
            print(f"    {reason}")
        else:
            degraded_s, failures = p["degraded_s"], p["failures"]
            print(f"tool.recovered {tool} after {degraded_s:.1f} s degraded ({failures} failed calls meanwhile)")
')
  [ -n "$found" ] && break
  sleep 1
done
[ -n "$found" ] || die "no tool.degraded and tool.recovered for $SID"
echo "$found"

step "The tool metrics in the stack's Prometheus (dsec_tool_errors_total by class)" \
  "curl PROMETHEUS/api/v1/query?query=sum by (tool, class) (dsec_tool_errors_total)"
PROM=$(dsec status --json | python3 -c '
import json, sys
def find(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "prometheus" and isinstance(value, dict) and value.get("endpoint"):
                return value["endpoint"]
            hit = find(value)
            if hit:
                return hit
    return None
print(find(json.load(sys.stdin)) or "")')
[ -n "$PROM" ] || die "no Prometheus in dsec status"
shown=0
for _ in $(seq "$WAIT_S"); do  # scraped every 5 s
  if python3 - "$PROM" <<'PY'
import json, sys, urllib.parse, urllib.request
url = sys.argv[1].rstrip("/")
def query(expr):
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=5) as r:
        return json.load(r)["data"]["result"]
errors = query('sum by (tool, class) (dsec_tool_errors_total{agent="flaky-search"})')
if not any(r["metric"].get("class") == "auth" for r in errors):
    sys.exit(1)
for r in errors:
    print(f"dsec_tool_errors_total{{tool={r['metric']['tool']}, class={r['metric']['class']}}} = {r['value'][1]}")
for r in query('sum by (tool) (dsec_tool_retries_total{agent="flaky-search"})'):
    print(f"dsec_tool_retries_total{{tool={r['metric']['tool']}}} = {r['value'][1]}")
for r in query('sum by (tool, fallback) (dsec_tool_fallbacks_total{agent="flaky-search"})'):
    print(f"dsec_tool_fallbacks_total{{tool={r['metric']['tool']}, fallback={r['metric']['fallback']}}} = {r['value'][1]}")
for r in query('histogram_quantile(0.5, sum by (tool, le) (dsec_tool_latency_ms_bucket{agent="flaky-search",side="call"}))'):
    print(f"p50 latency of {r['metric']['tool']}: {float(r['value'][1]):.0f} ms")
PY
  then shown=1; break; fi
  sleep 1
done
[ "$shown" = 1 ] || die "Prometheus has no dsec_tool_errors_total of flaky-search"
