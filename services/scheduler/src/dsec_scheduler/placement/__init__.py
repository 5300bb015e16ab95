"""GPU-aware placement: compute units, GPU shares in thousandths, gangs, fragmentation-aware
packing. Pure (no I/O); :mod:`.api` holds the types the scheduler service and the benchmark
share, the engine implements :class:`.api.PlacementEngine`."""
