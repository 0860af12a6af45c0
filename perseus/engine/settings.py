"""The native engine's settings: every field of the core's ``Settings`` struct, declared once.

:data:`ENGINE_FIELDS` lists the fields in the order of ``native/settings.h``, each with its C++ type and the
knobs (:mod:`perseus.base.knobs`) it is computed from. ``tools/gen_settings.py`` writes the header from this
table and the knobs' defaults; :func:`engine_values` computes every field's value from resolved knobs, which
:class:`perseus.engine.native.Engine` copies into the core's struct. The engine reads the struct once, when it
is created; nothing on the per-request path looks at knobs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from perseus.base.knobs import knob

__all__ = ["EngineField", "ENGINE_FIELDS", "ENGINE_SETTINGS", "engine_values", "allreduce_algorithm",
           "interface_names", "CROSS_HOST_CHANNELS", "topology_channels"]

#: channels per process set when num_channels is left at 0 (by topology) and the job spans several hosts: one
#: TCP flow each between hosts, so several fill a link whose single flows cannot (docs/benchmarks.md)
CROSS_HOST_CHANNELS = 8


def topology_channels(num_channels: int, multi_host: bool) -> int:
    """The channels per process set for the knob value ``num_channels``: that value when it is positive (the
    user's choice always wins), else (0: by topology) :data:`CROSS_HOST_CHANNELS` when the job's ranks span
    more than one host and 1 on a single shared-memory host.

    Raises:
        ValueError: ``num_channels`` is negative.
    """
    num_channels = int(num_channels)
    if num_channels < 0:
        raise ValueError(f"perseus setting num_channels (PERSEUS_NUM_CHANNELS): {num_channels} is negative; use "
                         "a positive count, or 0 to choose by topology")
    if num_channels > 0:
        return num_channels
    return CROSS_HOST_CHANNELS if multi_host else 1


def allreduce_algorithm(settings) -> str:
    """The all-reduce algorithm the knobs of ``settings`` choose: ``allreduce_algorithm``, except that
    ``hierarchical_allreduce`` (Horovod's switch) turns ``auto`` into ``hierarchical``.

    Raises:
        ValueError: the algorithm is not one of the knob's choices.
    """
    name = str(settings.allreduce_algorithm).lower()
    choices = knob("allreduce_algorithm").choices
    if name not in choices:
        raise ValueError(f"perseus setting allreduce_algorithm: unexpected value {settings.allreduce_algorithm!r}; "
                         f"expected one of {', '.join(choices)}")
    if settings.hierarchical_allreduce and name == "auto":
        return "hierarchical"
    return name


def interface_names(text: str) -> list[str]:
    """The network interface names listed in ``text`` (separated by commas or spaces), in order."""
    return [name for name in str(text).replace(",", " ").split(" ") if name]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineField:
    """One field of the core's ``Settings``.

    ``knobs`` names the knobs it is computed from: the first one's value as it is, or ``compute(settings)``
    when given. A field without knobs is set by the engine's creator (per rank, not from the environment) and
    starts at ``default``. ``note`` becomes the field's comment in the header.
    """

    name: str
    ctype: str
    knobs: tuple[str, ...] = ()
    compute: Optional[Callable[[Any], Any]] = None
    default: Any = None
    note: str = ""


ENGINE_FIELDS: tuple[EngineField, ...] = (
    EngineField("fusion_threshold_bytes", "int64_t", ("fusion_threshold_bytes",)),
    EngineField("inplace_threshold_bytes", "int64_t", ("inplace_threshold_bytes",)),
    EngineField("device_fusion_threshold_bytes", "int64_t", ("device_fusion_threshold_bytes",),
                note="units of device requests (device_channel.h)"),
    EngineField("device_bucket_bytes", "int64_t", ("device_bucket_bytes",),
                note="the budget of a device bucket; 0: no buckets (device_buckets.h)"),
    EngineField("device_cycle_time_ms", "double", ("device_cycle_time_ms",),
                note="the cycle when only device requests are new"),
    EngineField("cycle_time_ms", "double", ("cycle_time_ms",)),
    EngineField("num_channels", "int", ("num_channels",)),
    EngineField("max_channels", "int", ("max_channels",),
                note="channels created per set (a TUNE request may activate up to this many)"),
    EngineField("track_steps", "bool", ("autotune",),
                note="time training steps for the run-time tuner (ProcessSet::steps)"),
    EngineField("algorithm", "Algorithm", ("allreduce_algorithm", "hierarchical_allreduce"), allreduce_algorithm),
    EngineField("cache_capacity", "int64_t", ("cache_capacity",)),
    EngineField("engine_lane_bytes", "int64_t", ("engine_lane_bytes",),
                note="host all-reduce units up to this size run on the engine thread (engine_lane.h)"),
    EngineField("stall_check_disable", "bool", ("stall_check_disable",)),
    EngineField("stall_check_time_s", "double", ("stall_check_time_s",)),
    EngineField("stall_shutdown_time_s", "double", ("stall_shutdown_time_s",)),
    EngineField("idle_poll_max_ms", "double", ("idle_poll_max_ms",)),
    EngineField("host_key", "int64_t", default=0,
                note="ranks with equal keys are on one host (Python gives the world rank of the host's first rank)"),
    EngineField("hierarchical_allgather", "bool", ("hierarchical_allgather",)),
    EngineField("huge_pages", "bool", ("huge_pages",), note="collapse reused large host buffers into huge pages"),
    EngineField("network_interfaces", "std::vector<std::string>", ("network_interface",),
                lambda s: interface_names(s.network_interface),
                note="for the channels' links between hosts; empty: all"),
    EngineField("link_timeout_s", "double", ("link_timeout_s",)),
    EngineField("cpu_core", "int", default=-1,
                note="pin the engine thread to this core (from PERSEUS_THREAD_AFFINITY); -1: no pinning"),
)

#: The knobs the engine reads (names as in perseus.base.knobs).
ENGINE_SETTINGS: tuple[str, ...] = tuple(dict.fromkeys(name for f in ENGINE_FIELDS for name in f.knobs))


def engine_values(settings, **per_rank: Any) -> dict[str, Any]:
    """Every field's value, by field name: computed from the resolved knobs ``settings`` (any object with the
    knobs of :data:`ENGINE_SETTINGS` as attributes) and, for the fields without knobs, from ``per_rank``
    (None or absent: the field's default). The algorithm is a name ('auto', 'mpi', 'ring', 'hierarchical').

    Raises:
        ValueError: a knob value the engine cannot use (an unknown algorithm).
        TypeError: ``per_rank`` names a field that is computed from knobs, or no field at all.
    """
    wrong = set(per_rank) - {f.name for f in ENGINE_FIELDS if not f.knobs}
    if wrong:
        raise TypeError(f"engine_values(): {', '.join(sorted(wrong))} are not per-rank engine settings")
    values = {}
    for f in ENGINE_FIELDS:
        if not f.knobs:
            given = per_rank.get(f.name)
            values[f.name] = f.default if given is None else given
        elif f.compute is not None:
            values[f.name] = f.compute(settings)
        else:
            values[f.name] = getattr(settings, f.knobs[0])
    return values
