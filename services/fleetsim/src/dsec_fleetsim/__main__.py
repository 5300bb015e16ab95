"""Run the simulated fleet: ``python -m dsec_fleetsim``."""

import sys

from dsec_fleetsim.main import main

if __name__ == "__main__":
    sys.exit(main())
