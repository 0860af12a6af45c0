"""Compatibility helpers for running Horovod-targeted code on perseus."""
