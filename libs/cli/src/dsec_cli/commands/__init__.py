"""CLI command groups. Each module defines ``register(app)`` and is discovered by ``main``."""
