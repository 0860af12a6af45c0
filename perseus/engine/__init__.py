"""The engine: the native core (``native/``, loaded as :mod:`perseus._core`) and its Python shell.

The core owns the per-request path, one C++ file per stage: ``handles`` (requests, completion), ``process_set``
(queue and negotiation rounds), ``negotiation`` (bit-vector agreement on ready tensors), ``fusion`` (packing and
splitting into units), ``channels`` (concurrent communication threads), ``transport_mpi`` and
``transport_loopback``. Here: :mod:`~perseus.engine.native` (loading the core, the Engine object),
:mod:`~perseus.engine.settings` (the core's settings struct, from knobs),
:mod:`~perseus.engine.messages` (dtype and op numbering) and :mod:`~perseus.engine.stall` (where the main thread
is, for stall reports). No framework is imported here.
"""
