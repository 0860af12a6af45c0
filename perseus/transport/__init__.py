"""Transports that move the engine's buffers between ranks: :mod:`~perseus.transport.mpi` (mpi4py)."""
