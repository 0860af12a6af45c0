"""The runtime layer: one :class:`perseus.runtime.state.Runtime` per process (settings, topology, the engine,
the process sets, the timeline), its start-up phases, and the framework-neutral collectives that turn buffers
into engine requests. Services (the tuner, the elastic side) are built on it; it never imports them."""
