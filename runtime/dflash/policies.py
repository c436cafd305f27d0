"""The window policies by name: a small registry (nothing imports it back: it sits above the
interface in policy.py and the policies that implement it)."""

from __future__ import annotations

from collections.abc import Callable

from dspark.runtime.dflash.dwc import DynamicWindow
from dspark.runtime.dflash.goodput import GoodputWindow
from dspark.runtime.dflash.policy import FixedWindow, WindowPolicy
from dspark.runtime.errors import DSparkError

POLICIES: dict[str, Callable[..., WindowPolicy]] = {
    "fixed": FixedWindow, "dflash": DynamicWindow, "goodput": GoodputWindow}


def make_policy(name: str, **kwargs) -> WindowPolicy:
    """kwargs: window (fixed), config (WindowConfig), costs (CostModel) as each needs."""
    if name not in POLICIES:
        raise DSparkError(f"unknown window policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return POLICIES[name](**kwargs)
