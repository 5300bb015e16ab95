"""Run the nodeagent service: ``python -m dsec_nodeagent``."""

from dsec_core.service import main

from dsec_nodeagent.app import create_service

if __name__ == "__main__":
    main(create_service)
