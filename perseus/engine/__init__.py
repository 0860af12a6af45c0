"""The engine: one background thread per process that negotiates, fuses and completes requests.

Stages, one module each: :mod:`~perseus.engine.messages` (requests and signatures),
:mod:`~perseus.engine.negotiation` (bit-vector agreement on ready tensors), :mod:`~perseus.engine.fusion`
(packing and splitting into all-reduce units), :mod:`~perseus.engine.channels` (concurrent communication
channels), :mod:`~perseus.engine.handles` (completion handles for the adapters), :mod:`~perseus.engine.stall`
(stall inspection), :mod:`~perseus.engine.runtime` and :mod:`~perseus.engine.loop` (the background loop).
No framework is imported here.
"""
