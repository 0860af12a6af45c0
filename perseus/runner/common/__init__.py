"""Horovod-compat path: keep names and signatures identical to horovod.runner.common."""

__all__: list[str] = []
