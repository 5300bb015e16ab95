"""I/O of the snapshot library: S3 objects, Vault keys, NVML, /proc, local files and caches."""
