"""Run the snapshot service: ``python -m dsec_snapshot``."""

from dsec_core.service import main

from dsec_snapshot.app import create_service

if __name__ == "__main__":
    main(create_service)
