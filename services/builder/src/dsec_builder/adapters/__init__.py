"""I/O of the builder: the uv engine, the cache tiers and the environment store."""
