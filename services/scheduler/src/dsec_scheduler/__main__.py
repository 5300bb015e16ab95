"""Run the scheduler service: ``python -m dsec_scheduler``."""

from dsec_core.service import main

from dsec_scheduler.app import create_service

if __name__ == "__main__":
    main(create_service)
