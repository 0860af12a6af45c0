"""Activity names written to the timeline, matching the names Horovod's timeline uses.

A tensor's row shows ``NEGOTIATE_<OP>`` while ranks agree on it, then ``<OP>`` (for example ``ALLREDUCE``)
until its result is ready, with the sub-activities below nested inside ``<OP>``.
"""

__all__ = [
    "PROCESS_NAME",
    "NEGOTIATE_PREFIX",
    "CYCLE_START",
    "MEMCPY_IN_FUSION_BUFFER",
    "MPI_ALLREDUCE",
    "MEMCPY_OUT_FUSION_BUFFER",
    "TIMELINE_TRUNCATED",
    "WIRE_BYTES",
    "negotiate_name",
]

#: Name of the pid-0 row, which carries the cycle markers and the truncation marker.
PROCESS_NAME = "perseus"

#: Prefix of the negotiation activity; the op type's name follows it.
NEGOTIATE_PREFIX = "NEGOTIATE_"

#: Instant event marking the start of one engine cycle (only with ``mark_cycles``).
CYCLE_START = "CYCLE_START"

#: Copying a tensor into the fusion buffer.
MEMCPY_IN_FUSION_BUFFER = "MEMCPY_IN_FUSION_BUFFER"

#: The all-reduce collective itself.
MPI_ALLREDUCE = "MPI_ALLREDUCE"

#: Copying a result out of the fusion buffer.
MEMCPY_OUT_FUSION_BUFFER = "MEMCPY_OUT_FUSION_BUFFER"

#: Instant event written once when the file reaches its size limit; nothing is recorded after it.
TIMELINE_TRUNCATED = "TIMELINE_TRUNCATED"


#: Counter track on the pid-0 row: bytes of the global process set sent and received on the wire since
#: recording began (``sent_bytes``, ``received_bytes``, ``control_sent_bytes``, ``control_received_bytes``).
WIRE_BYTES = "WIRE_BYTES"


def negotiate_name(op_type_name: str) -> str:
    """Return the negotiation activity name for an op type name, e.g. ``"NEGOTIATE_ALLREDUCE"``."""
    return NEGOTIATE_PREFIX + op_type_name
