"""What a perseus setting is: its declaration, how its text is parsed, and the resolved values.

:class:`Knob` declares one setting (its environment variables, type, default, unit and meaning) and
:class:`Flag` how ``perseusrun`` offers it on the command line; :func:`parse_bool` and
:func:`parse_reset_limit` turn environment text into values (raising ``ValueError`` that names the accepted
spellings); :class:`Settings` holds every knob's resolved value. The table of every knob, and reading it from
the environment, is :mod:`perseus.base.knobs`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

__all__ = ["Knob", "Flag", "Settings", "parse_bool", "parse_reset_limit"]

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


def parse_bool(text: str) -> bool:
    """Parse an environment truth value; raise ``ValueError`` naming the accepted spellings."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    try:  # Horovod's C++ parser treats any positive integer as true.
        return int(low) > 0
    except ValueError:
        raise ValueError(f"invalid truth value {text!r}; use 1/0, true/false, yes/no or on/off") from None


def parse_reset_limit(text: str) -> Optional[int]:
    """An elastic reset limit: an integer >= 0, or ``none``/``unlimited`` (None) for no limit."""
    low = text.strip().lower()
    if low in ("none", "unlimited"):
        return None
    try:
        value = int(low)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"expected an integer >= 0, or 'none' for no limit, got {text!r}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How ``perseusrun`` offers a knob on its command line (horovodrun's spelling and unit).

    A bool knob's flag is a switch that sets it (``negation``, if given, clears it); any other knob's flag
    takes a value, which is multiplied by ``scale`` (MB on the command line, bytes in the knob) and must be
    at least ``minimum``. The help text of a flag is its own ``help``, else the knob's ``doc``.
    """

    name: str
    group: str
    help: str = ""
    negation: str = ""
    scale: float = 1.0
    minimum: float = 0.0
    aliases: tuple[str, ...] = ()  # other spellings of ``name`` (horovodrun's deprecated or related ones)
    negation_aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Knob:
    """One setting: its name, environment variables, type, default, unit, meaning, and perseusrun flag."""

    name: str
    env: tuple[str, ...]
    type: Callable[[str], Any]
    default: Any
    doc: str
    unit: str = ""
    tunable: bool = False
    choices: tuple[str, ...] = ()
    flag: Optional[Flag] = None

    def parse(self, text: str, var: str = "") -> Any:
        """Convert the string ``text`` (read from ``var``) to this knob's type; ``ValueError`` names ``var``."""
        var = var or self.env[0]
        try:
            value = parse_bool(text) if self.type is bool else self.type(text.strip())
        except ValueError as exc:
            raise ValueError(f"environment variable {var}: {exc}") from None
        if self.choices and str(value).lower() not in self.choices:
            raise ValueError(
                f"environment variable {var}: unexpected value {text!r}; "
                f"expected one of {', '.join(self.choices)}"
            )
        return value

    def read(self, environ: Mapping[str, str]) -> tuple[Any, bool]:
        """Return ``(value, explicitly_set)`` from the first of :attr:`env` that is set."""
        for var in self.env:
            if var in environ and environ[var].strip() != "":
                return self.parse(environ[var], var), True
        return self.default, False


class Settings:
    """The resolved value of every knob, read once at ``init()``. Unknown attributes are rejected."""

    __slots__ = ("_values", "_explicit")

    def __init__(self, values: dict[str, Any], explicit: frozenset[str]):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_explicit", explicit)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not a setting (copy/pickle probe before __init__ ran)
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"perseus has no setting {name!r}") from None

    def __reduce__(self):
        return (Settings, (self._values, self._explicit))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise AttributeError(f"perseus has no setting {name!r}")
        self._values[name] = value

    def is_explicit(self, name: str) -> bool:
        """True when the user set ``name`` through the environment (the autotuner leaves it alone)."""
        return name in self._explicit

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"Settings({self._values!r})"
