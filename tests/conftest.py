"""Shared pytest configuration: every test has a timeout (pytest-timeout; the default is in pyproject.toml)."""
