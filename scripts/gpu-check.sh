#!/usr/bin/env bash
# Prove the node agent's real NVML path on a GPU machine (after `./taskw setup`), in seconds:
#   1. nvidia-smi -L (what the driver sees), when present;
#   2. `python -m dsec_nodeagent.gpu`: every GPU as the node agent reports it in node.heartbeat
#      (model, uuid, PCI id, memory, temperature, utilization, ECC, XIDs, MIG, NVLinks, topology),
#      read twice (the second read drains the XID event set again).
# Exit 0: NVML found and every field of every GPU read (or "not supported" by the device).
# Exit 1: NVML is present but a field read failed (the error names the GPU and the field).
# Exit 2: no NVML or no GPU here: nothing was proven (the reason is printed).
# Environment: DSEC_VENV (default: <repo>/.venv).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${DSEC_VENV:-$REPO/.venv}/bin/python"
[[ -x "$PY" ]] || { echo "gpu-check: no $PY; run ./taskw setup first" >&2; exit 2; }

if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L || true
fi

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
rc=0
timeout 60 "$PY" -m dsec_nodeagent.gpu >"$out" || rc=$?
cat "$out"
if [[ $rc -ne 0 ]]; then
  echo "gpu-check: FAILED (exit $rc): NVML is present but a GPU field could not be read" >&2
  exit 1
fi
"$PY" - "$out" <<'PY'
import json, sys

report = json.load(open(sys.argv[1]))
probe, gpus = report.get("gpu_probe", ""), report.get("gpus", [])
if probe != "nvml" or not gpus:
    print(f"gpu-check: nothing proven: gpu_probe={probe!r}, {len(gpus)} GPU(s)", file=sys.stderr)
    sys.exit(2)
for g in gpus:
    links = sum(1 for link in g["nvlinks"] if link["active"])
    print(
        f"gpu-check: GPU {g['index']} {g['model']} {g['uuid']} {g['pci_bus_id']}: "
        f"{g['memory_used_bytes'] >> 20}/{g['memory_total_bytes'] >> 20} MiB, "
        f"{g['temperature_c']} C, {g['utilization_pct']} %, ECC {g['ecc_corrected']}/"
        f"{g['ecc_uncorrected']}, XID {g['xid_errors']}, MIG {g['mig_enabled']}, "
        f"NVLinks up {links}/{len(g['nvlinks'])}, peers {g['topology']}",
        file=sys.stderr,
    )
print(f"gpu-check: OK, {len(gpus)} GPU(s) read through NVML", file=sys.stderr)
PY
