"""Shared pytest configuration: every test has a timeout (pytest-timeout, set in setup.cfg)."""
