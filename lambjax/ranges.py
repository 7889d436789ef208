"""Numeric settings against their valid range, written as an interval: `"(0, 1]"`, `"[0, inf)"`.

`check(field, value, interval)` raises ValueError naming the field, the value and the
interval. NaN compares false with every number, so a check written `if value <= 0: raise`
lets `nan` through, and `inf` passes every lower bound; here a value must lie inside the
interval, and infinity only where the interval includes it (`"[0, inf]"`).
"""

import math


def check(field: str, value, interval: str, *, integer: bool = False) -> None:
    """Raises ValueError unless `value` lies in `interval` (and is an integer if `integer`)."""
    low, high, low_open, high_open = _parse(interval)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and (not integer or isinstance(value, int)) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    if not ok:
        raise ValueError(f"{field}={value!r} must {describe(interval, integer=integer)}")


def describe(interval: str, *, integer: bool = False) -> str:
    """What `check` asks of a value, in words: "lie in (0, 1]", "be a number > 0"."""
    low, high, low_open, high_open = _parse(interval)
    kind = "an integer" if integer else "a number"
    if (low, high, low_open, high_open) == (-math.inf, math.inf, True, True):
        return f"be {'a finite number' if not integer else kind}"
    if high == math.inf and low > -math.inf:
        bound = f"{'>' if low_open else '>='} {_number(low)}"
        if not high_open:
            return f"be {kind} {bound} (inf included)"
        return f"be {'a finite number' if not integer else kind} {bound}"
    return f"be {kind} in {interval}" if integer else f"lie in {interval}"


def _parse(interval: str) -> tuple[float, float, bool, bool]:
    low, high = (float(part) for part in interval[1:-1].split(","))
    return low, high, interval[0] == "(", interval[-1] == ")"


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)
