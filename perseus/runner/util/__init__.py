"""Horovod-compat path: keep names and signatures identical to horovod.runner.util."""

__all__: list[str] = []
