"""Run the builder service: ``python -m dsec_builder``."""

from dsec_core.service import main

from dsec_builder.app import create_service

if __name__ == "__main__":
    main(create_service)
