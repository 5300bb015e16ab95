"""Run at the start of every Python process in a DSec sandbox: the user site directory.

The node agent shows this directory as the interpreter's user site-packages
(``$PYTHONUSERBASE/lib/pythonX.Y/site-packages``), which ``site`` adds to the import path after
the standard library and then imports ``usercustomize`` from. Not ``PYTHONPATH``: an entry
there comes before the standard library, and every import of the interpreter's start looked in
it first (about 0.5 ms of each sandboxed start on the project's VM). Not ``sitecustomize``: the
runtime's own (a distribution's) would come first on the path and hide it.

Adds the built environment's site-packages (with its ``.pth`` files), then the packages the DSec
SDK needs (after the environment's, so a version the spec pinned wins) and, when the node agent
wrote rules, installs the semantic layer. Standard library only: it runs before user code.
"""

import os
import site
import sys

_env_site = os.environ.get("DSEC_ENV_SITE")
if _env_site:
    site.addsitedir(_env_site)

_sdk_deps = os.environ.get("DSEC_SDK_DEPS")
if _sdk_deps and _sdk_deps not in sys.path:
    sys.path.append(_sdk_deps)

_rules = os.environ.get("DSEC_SEMANTIC_RULES")
if _rules and os.path.exists(_rules):
    import dsec_semantic_runtime

    dsec_semantic_runtime.install(_rules, os.environ.get("DSEC_SEMANTIC_SOCKET"))
