"""c.GpuFrac's trait types: a value of the wrong type or out of range is noted, never raised."""

from __future__ import annotations

import math
from typing import Any

from traitlets import Bool, Float, Int, List, TraitError, TraitType, Unicode


def expected(trait: TraitType[Any, Any]) -> str:
    """What ``trait`` takes, in words, with its range."""
    if isinstance(trait, Bool):
        return "True or False"
    if isinstance(trait, Unicode):
        return "a string"
    if isinstance(trait, List):
        return "a list of strings"
    what = "a whole number" if isinstance(trait, Int) else (
        "seconds" if trait.metadata.get("unit") == "seconds" else "a finite number")
    low = getattr(trait, "min", None)
    high = getattr(trait, "max", None)
    low = None if low in (None, -math.inf) else low
    high = None if high in (None, math.inf) else high
    if low is not None and high is not None:
        what += f" from {low:.12g} to {high:.12g}"
    elif low is not None:
        what += f" of at least {low:.12g}"
    elif high is not None:
        what += f" of at most {high:.12g}"
    return what + (" (or None)" if trait.allow_none else "")


class _Noted(TraitType[Any, Any]):
    """A trait whose refused value becomes a noted config problem and the default: traitlets
    would raise, and one bad value in c.GpuFrac would drop every other setting with it. Its
    owner has ``bad_value(name, problem)``."""

    def validate(self, obj: Any, value: Any) -> Any:
        try:
            checked = super().validate(obj, value)  # type: ignore[misc]
            if isinstance(checked, float) and not math.isfinite(checked):
                raise TraitError(self.name)  # NaN passes any bounds, an infinity open ones
            return checked
        except TraitError:
            obj.bad_value(str(self.name), f"c.{type(obj).__name__}.{self.name}: expected "
                                          f"{expected(self)}, got {value!r}"[:300])
            return self.default_value


class NotedBool(_Noted, Bool):
    """Bool, noted."""


class NotedInt(_Noted, Int):
    """Int, noted."""


class NotedFloat(_Noted, Float):
    """Float, noted."""


class NotedUnicode(_Noted, Unicode):
    """Unicode, noted."""


class NotedList(_Noted, List):
    """List, noted."""
