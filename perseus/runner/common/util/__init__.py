"""Horovod-compat path: keep names and signatures identical to horovod.runner.common.util."""

__all__: list[str] = []
