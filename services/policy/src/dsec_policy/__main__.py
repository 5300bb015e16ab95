"""Run the policy service: ``python -m dsec_policy``."""

from dsec_core.service import main

from dsec_policy.app import create_service

if __name__ == "__main__":
    main(create_service)
