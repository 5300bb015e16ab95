"""Run at the start of every Python process in a DSec sandbox (found via ``PYTHONPATH``).

Adds the built environment's site-packages (with its ``.pth`` files) and, when the node agent
wrote rules, installs the semantic layer. Standard library only: it runs before user code.
"""

import os
import site

_env_site = os.environ.get("DSEC_ENV_SITE")
if _env_site:
    site.addsitedir(_env_site)

_rules = os.environ.get("DSEC_SEMANTIC_RULES")
if _rules and os.path.exists(_rules):
    import dsec_semantic_runtime

    dsec_semantic_runtime.install(_rules, os.environ.get("DSEC_SEMANTIC_SOCKET"))
