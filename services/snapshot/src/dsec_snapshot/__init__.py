"""The snapshot service: what is not bound to a node.

Snapshots of sandboxes that run nowhere (from their code bundle in S3), periodic snapshot
requests (the owning node agent takes them), retention, and deletes (``snapshot.delete_requested``
→ ``snapshot.deleted``). The data path itself is the library :mod:`dsec_snapstore`, re-exported
here for older imports.
"""

from dsec_snapstore import *  # noqa: F403
from dsec_snapstore import __all__ as __all__
