"""VLB, the verification load balancer.

Every request's first draft token is verified (fast lane); further draft tokens (steady
lane) are admitted by the executor's utilisation u: below `low_utilisation` up to
`steady_tokens_low` per round, up to `high_utilisation` `steady_tokens_mid`, above it none.
Tokens not admitted are held: they stay valid for the next round and are dropped if an
earlier token is rejected (see Engine.accept).

What "utilisation" means on a CPU: the engine thread is busy whenever any request runs, so
a busy fraction reads ~1 at any load. What matters is whether the verify forward is still
streaming weights (extra tokens nearly free) or computing (each token costs its share), so
u is the verify's marginal cost per token over its average cost per token at the current
verify size, from the measured cost table (a slope fitted around that size): ~0.1 for one
request, -> 1 when compute-bound.

Beyond the seed, the balancer also caps the window of the whole batch by what pays at its
size: n requests drafting w tokens each, every token surviving with the draft model's
measured rate a, yield n (1 + a + ... + a^w) tokens for w t_draft(n) + t_main(n (w + 1))
seconds (costs of n sequences, see costs.py); the cap is the w from 1 with the most tokens
per second. It does not go to 0: whether a batch speculates at all is measured (below), and
a cap of 0 was a trap. The model then drafted in no batch, so its acceptance was never
measured again and the cap stayed 0. Priced from a prior and a few early rejections (lookup
rounds counted too, until they were left out: the cap sizes the model's windows), the fp32
sample at 4 sequences sat at plain's speed with the model's drafts holding ~95% of the time,
and its speculating steps realizing 1.5x plain's tokens per second. With one request the
window policy alone decides.

Whether a batch speculates at all is measured, not modelled (`speculate`, batch_modes.py):
per batch size the realized tokens per second of speculating and of plain steps; a step
that feeds a prompt never speculates (engine/decide.py), so a waiting request's first token is
not held behind verify windows.
"""

from __future__ import annotations

from dspark.runtime.bundle.config import VerifyBalanceConfig
from dspark.runtime.dflash.batch_modes import BatchModes
from dspark.runtime.model.costs import CostModel

PRIOR_ACCEPT = 0.7
SMOOTHING = 0.05


class VerifyBalancer:
    def __init__(self, config: VerifyBalanceConfig, costs: CostModel):
        self.config = config
        self.costs = costs
        self.acceptance = PRIOR_ACCEPT  # of the model's first drafts, EWMA over rounds
        self.verify_tokens = 1  # size of the last verify forward
        self.modes = BatchModes(config.mode_explore_every)

    def configure(self, config) -> None:
        self.config = config.verify_balance
        self.modes.explore_every = self.config.mode_explore_every

    def speculate(self, sequences: int) -> bool:
        """Does a step of `sequences` sequences speculate (batch_modes.py)?"""
        return not self.config.batch_modes or self.modes.speculate(sequences)

    def observe_step(self, sequences: int, speculated: bool, tokens: int,
                     seconds: float, after_idle: bool = False) -> None:
        """A step that fed no prompt: its mode's output tokens per second, by batch size."""
        self.modes.observe(sequences, speculated, tokens, seconds, after_idle)

    def observe(self, tokens: int, seconds: float) -> None:
        """After a verify forward of `tokens` tokens."""
        self.verify_tokens = max(1, tokens)

    def observe_round(self, first_accepted: bool) -> None:
        """After a round whose first verified draft the draft model proposed."""
        self.acceptance += SMOOTHING * (float(first_accepted) - self.acceptance)

    @property
    def utilisation(self) -> float:
        """The verify's marginal cost per token over its average at the current size. The
        marginal cost is the least-squares slope of the measured sizes from the power of two
        at or below that size up to twice it (at least 8): between neighbouring sizes (the
        cost table keeps each small size apart) one noisy entry read as compute-bound,
        admitted only the first draft, and a table that then only measured 2-token verifies
        never corrected it."""
        tokens = self.verify_tokens
        measured = self.costs.table.get("main") or {}
        lo = 1 << (tokens.bit_length() - 1)
        hi = max(2 * lo, 8)
        points = [(n, t) for n, t in measured.items() if lo <= n <= hi]
        now = self.costs.seconds("main", tokens)
        if len(points) < 2 or hi > max(measured) or not now:  # no evidence of saturation
            return 0.0
        mx = sum(n for n, _ in points) / len(points)
        my = sum(t for _, t in points) / len(points)
        marginal = sum((n - mx) * (t - my) for n, t in points) / sum(
            (n - mx) ** 2 for n, _ in points)
        return max(0.0, min(1.0, marginal * tokens / now))

    def batch_cap(self, drafting: int, wanted: int) -> int:
        """The window (1..wanted) that maximises tokens per second for `drafting`
        sequences this round; `wanted` when nothing is measured yet, 0 when it is 0."""
        t, a, n = self.costs.seconds, self.acceptance, drafting
        draft = t("draft", n, n)
        if n < 2 or not self.config.batch_cap or draft is None or t("main", n) is None:
            return wanted  # one request: its window policy alone decides

        def rate(w: int) -> float:
            return n * sum(a ** j for j in range(w + 1)) / (w * draft + t("main", n * (w + 1), n))
        return max(range(1, wanted + 1), key=rate, default=0)

    def steady_tokens(self) -> int:
        cfg, u = self.config, self.utilisation
        if u < cfg.low_utilisation:
            return cfg.steady_tokens_low
        if u <= cfg.high_utilisation:
            return cfg.steady_tokens_mid
        return 0

    def admit(self, drafted: int) -> int:
        """How many of `drafted` tokens go into this round's verify."""
        return min(drafted, 1 + self.steady_tokens()) if drafted else 0
