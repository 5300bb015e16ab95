"""Stand-in health threshold for the demo's simulated fleet: follows the simulated nodes'
heartbeats and, when a GPU passes 85 °C, publishes ``gpu.degraded`` signed as that node's agent
(the simulated fleet's certified key for the node, as the fleet itself signs), then exits.

Run it where ``dsec fleet simulate`` runs (the operator's machine: the root key and the fleet's
seed under ``$DSEC_HOME``), connected as the fleet (``DSEC_NATS_NKEY_SEED=$DSEC_HOME/nats/
fleetsim.nk``). Usage: ``python examples/gpu-migration/watch_heat.py PREFIX [TIMEOUT_S]``.
Prints one JSON line (what it published); exit 1 when no GPU passed the threshold in time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from dsec_core.bus import EventPublisher, connect, follow
from dsec_core.envelope import decode
from dsec_core.events import GpuDegraded
from dsec_core.settings import Settings
from dsec_core.subjects import STREAM, filter_for
from dsec_fleetsim.identities import certify, fleet_secret, root_key

THRESHOLD_C = 85.0


async def main(prefix: str, timeout_s: float) -> int:
    settings = Settings()
    root, secret = root_key(settings.home), fleet_secret(settings.home)
    nc = await connect(settings, "dsec-fleetsim")
    try:
        js = nc.jetstream()
        start = (await js.stream_info(STREAM)).state.last_seq + 1
        deadline = time.monotonic() + timeout_s
        beats = filter_for("node.heartbeat")
        async for batch in follow(js, filter_subject=beats, start_seq=start, idle_s=0.5):
            for _, data in batch:
                beat = decode(data).payload
                node = str(beat.get("node_id", ""))
                if not node.startswith(prefix):
                    continue
                for gpu in beat["inventory"]["gpus"]:
                    temperature = float(gpu.get("temperature_c") or 0.0)
                    if temperature <= THRESHOLD_C:
                        continue
                    ident = certify(root, secret, node)
                    publisher = EventPublisher(js, ident.signer(), certificate=ident.cert)
                    degraded = GpuDegraded(
                        node_id=node,
                        gpu_index=int(gpu["index"]),
                        gpu_uuid=str(gpu.get("uuid") or ""),
                        signal="temperature",
                        value=temperature,
                        threshold=THRESHOLD_C,
                        detail=f"GPU {gpu['index']} of {node} at {temperature:g} °C",
                        source="simulated",
                    )
                    await publisher.publish(degraded, aggregate_id=node)
                    print(json.dumps(degraded.model_dump(mode="json")), flush=True)
                    return 0
            if time.monotonic() > deadline:
                return 1
        return 1
    finally:
        await nc.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 120.0)))
