"""Chrome-trace JSON timeline of the engine's activity, recorded on rank 0.

Open the file in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``. Every tensor name is one row;
activity names are those of Horovod's timeline (see :mod:`perseus.timeline.events`).
"""

from perseus.timeline.writer import Timeline

__all__ = ["Timeline"]
