"""perseusrun's elastic flags (horovodrun's: ``--host-discovery-script``, ``--min-np``, ``--max-np``, ...):
their names and the checks of their values, made before anything starts.

The elastic job itself is run by :mod:`perseus.runner.elastic_run`.
"""

from __future__ import annotations

import argparse
from typing import Optional

from perseus.runner.errors import LaunchError

__all__ = ["ELASTIC_FLAGS", "check_elastic_args", "DEFAULT_ELASTIC_TIMEOUT_S"]

#: horovodrun's default wait for enough hosts.
DEFAULT_ELASTIC_TIMEOUT_S = 600.0

#: the elastic flags: argparse destination -> the flag as messages name it
ELASTIC_FLAGS = {"min_np": "--min-np", "max_np": "--max-np", "slots_per_host": "--slots-per-host",
                 "host_discovery_script": "--host-discovery-script", "reset_limit": "--reset-limit",
                 "cooldown_range": "--blacklist-cooldown-range", "elastic_timeout": "--elastic-timeout"}


def _int(args, dest: str, low: int) -> Optional[int]:
    text = getattr(args, dest)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise LaunchError(f"{ELASTIC_FLAGS[dest]} must be an integer >= {low}, got {text!r}")
    return value


def check_elastic_args(args: argparse.Namespace) -> dict:
    """The elastic settings from perseusrun's flags, checked.

    The hosts come from ``--host-discovery-script`` or, as with horovodrun, from a fixed ``-H``/``--hostfile``
    list (the job still re-forms without a failed host, and shrinks to ``--min-np``).

    Raises:
        LaunchError: an elastic flag with neither ``--host-discovery-script`` nor ``-H``/``--hostfile``, both of
            them, or a value out of range (``--min-np`` > ``--max-np``, a cool-down range with LO > HI, ...).
    """
    given = [flag for dest, flag in ELASTIC_FLAGS.items() if getattr(args, dest, None) is not None]
    if args.host_discovery_script is None and not (args.hosts or args.hostfile):
        raise LaunchError(f"{', '.join(given)} need(s) --host-discovery-script (a script printing 'host:slots' "
                          f"lines) or -H/--hostfile (a fixed host list): an elastic job must know its hosts")
    if args.host_discovery_script is not None and (args.hosts or args.hostfile):
        raise LaunchError("--host-discovery-script cannot be combined with -H/--hosts or --hostfile: an elastic "
                          "job's hosts come from the script")
    min_np, max_np = _int(args, "min_np", 1), _int(args, "max_np", 1)
    slots = _int(args, "slots_per_host", 1)
    reset_limit = _int(args, "reset_limit", 0)
    np_ = args.num_proc or min_np or 1
    min_np = min_np or np_
    if max_np is not None and min_np > max_np:
        raise LaunchError(f"--min-np {min_np} is larger than --max-np {max_np}")
    if min_np > np_ or (max_np is not None and np_ > max_np):
        raise LaunchError(f"-np {np_} must lie between --min-np {min_np} and --max-np {max_np}")
    cooldown = None
    if args.cooldown_range is not None:
        try:
            low, high = (float(v) for v in args.cooldown_range)
        except ValueError:
            low = high = -1.0
        if not 0 <= low <= high:
            raise LaunchError(f"--blacklist-cooldown-range takes LO HI seconds with 0 <= LO <= HI, got "
                              f"{' '.join(args.cooldown_range)}")
        cooldown = (low, high)
    timeout = DEFAULT_ELASTIC_TIMEOUT_S
    if args.elastic_timeout is not None:
        try:
            timeout = float(args.elastic_timeout)
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise LaunchError(f"--elastic-timeout must be a positive number of seconds, got {args.elastic_timeout!r}")
    return dict(np_=np_, min_np=min_np, max_np=max_np, slots_per_host=slots, reset_limit=reset_limit,
                cooldown=cooldown, elastic_timeout=timeout)
