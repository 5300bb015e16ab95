"""I/O at the edges of the policy service (files on disk)."""
