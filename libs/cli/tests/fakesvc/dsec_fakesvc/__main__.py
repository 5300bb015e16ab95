"""Run :func:`dsec_testing.fakesvc.main`."""

from dsec_testing.fakesvc import main

main()
