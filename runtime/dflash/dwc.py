"""DWC, the dynamic window controller (policy "dflash"), from the seed.

Per round, from statistics only:
    degraded (reject-ratio EWMA over ~10 rounds > 0.25)  -> 2, until 5 clean rounds
    PLNP = generated / prompt < 0.3                      -> initial window (4)
    PLNP > 0.7                                           -> late window (3)
    0.3 <= PLNP <= 0.7                                   -> 6, 7 when the draft's confidence
        slope (mean |first difference| of its top-1 probability along the last window)
        is < 0.15, 8 when also the mean entropy (nats) of its renormalised top-3 is < 0.85
then clamped to [min_window, cap]. The windows are the config's for a device whose RAS row
starts at `window.initial`; on a device whose row starts elsewhere (the seed's table: A10G
4, A100 6, H100 8) every rule's window scales by row / initial, so the same rules serve a
slow CPU (row 2: 2, 3-4, 2) and a fast GPU (row 8: 8, 12-16, 6).

For the hybrid method (the CPU default) the window is the most the model may draft; the
hybrid's cost model decides how many it does (engine/decide.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.runtime.bundle.config import WindowConfig
from dspark.runtime.dflash.policy import RoundView


@dataclass
class DwcState:
    reject_ewma: float = 0.0
    degraded: bool = False
    clean_rounds: int = 0


class DynamicWindow:
    name = "dflash"

    def __init__(self, config: WindowConfig | None = None, start: int | None = None, **_):
        self.config = config or WindowConfig()
        self.start = start or self.config.initial  # the device's starting window (RAS)
        self.states: dict[int, DwcState] = {}

    def _target(self, view: RoundView, state: DwcState) -> int:
        cfg = self.config
        if state.degraded:
            return cfg.degrade_window
        if view.plnp < cfg.plnp_low:
            return cfg.initial
        if view.plnp > cfg.plnp_high:
            return cfg.late_window
        window = cfg.mid_window
        slope, entropy = view.stats.confidence_slope, view.stats.top3_entropy
        if slope is not None and slope < cfg.slope_threshold:
            window += 1
            if entropy is not None and entropy < cfg.entropy_threshold:
                window += 1
        return window

    def begin_round(self, drafting: int) -> None:
        pass

    def survival(self, view: RoundView, drafted: int) -> float | None:
        return None

    def window(self, view: RoundView) -> int:
        state = self.states.setdefault(view.seq_id, DwcState())
        scaled = round(self._target(view, state) * self.start / self.config.initial)
        return max(self.config.min_window, min(scaled, view.cap))

    def keep_drafting(self, view: RoundView, drafted: int) -> bool:
        return True

    def observe(self, view: RoundView) -> None:
        s = view.stats
        if not s.last_window:
            return
        state = self.states.setdefault(view.seq_id, DwcState())
        rejected = (s.last_window - s.last_accepted) / s.last_window
        smoothing = 2 / (self.config.reject_ewma_rounds + 1)
        state.reject_ewma += smoothing * (rejected - state.reject_ewma)
        if state.degraded:
            state.clean_rounds = state.clean_rounds + 1 if rejected == 0 else 0
            if state.clean_rounds >= self.config.recover_clean_rounds:
                state.degraded, state.reject_ewma = False, 0.0
        elif state.reject_ewma > self.config.degrade_reject_rate:
            state.degraded, state.clean_rounds = True, 0

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
