"""I/O of the embedded stack: processes, ports, probes, servers, services, state file."""
