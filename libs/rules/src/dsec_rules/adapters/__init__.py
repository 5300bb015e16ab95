"""I/O at the edges of the rules: code directories and bundles, the org policy file, the
stack's own endpoints."""
