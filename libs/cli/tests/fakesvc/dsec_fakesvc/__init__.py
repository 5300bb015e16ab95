"""``python -m dsec_fakesvc``: the stand-in service of :mod:`dsec_testing.fakesvc`, under the
``dsec_<name>`` module name ``dsec up -s fakesvc`` runs (put this directory on PYTHONPATH)."""
