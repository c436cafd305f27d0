"""The DFlash policies on their own: DWC rules (the seed's worked example), goodput's slot
selection, VLB lanes, cache health repairs, hot reload of the config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_kv_arena import arena  # noqa: F401 - the fixture

from dspark.runtime.bundle.config import (
    CacheHealthConfig,
    DFlashConfig,
    VerifyBalanceConfig,
    WindowConfig,
)
from dspark.runtime.dflash.batch_modes import MIN_STEPS, SETTLE_STEPS, TRIAL_STEPS, BatchModes
from dspark.runtime.dflash.che import CacheHealth, hit_rate, measure
from dspark.runtime.dflash.dwc import DynamicWindow
from dspark.runtime.dflash.goodput import select_slots
from dspark.runtime.dflash.policies import make_policy
from dspark.runtime.dflash.policy import RoundView
from dspark.runtime.dflash.reload import ConfigWatcher
from dspark.runtime.dflash.vlb import VerifyBalancer
from dspark.runtime.errors import DSparkError
from dspark.runtime.model.costs import AFTER_DRAFT, CostModel
from dspark.runtime.sequence.stats import SeqStats


def _view(generated, prompt=2000, top1=(), entropy=(), cap=8, seq=0, window=0, accepted=0):
    stats = SeqStats(draft_top1=list(top1), draft_entropy=list(entropy), last_window=window,
                     last_accepted=accepted)
    return RoundView(seq, "default", prompt, generated, stats, cap, tuple(top1))


CERTAIN = dict(top1=(0.97, 0.96, 0.97, 0.95), entropy=(0.3, 0.4, 0.3, 0.35))  # flat, peaked
FLAT_UNSURE = dict(top1=(0.6, 0.62, 0.6, 0.61), entropy=(0.95, 1.0, 0.9, 1.0))
JUMPY = dict(top1=(0.9, 0.3, 0.8, 0.2), entropy=(0.5, 0.9, 0.6, 1.0))


@pytest.mark.parametrize("generated,signals,want", [
    (0, {}, 4),  # first round: no statistics yet
    (150, CERTAIN, 4),  # the seed: PLNP 0.075 < 0.3 keeps the conservative 4 ...
    (299, CERTAIN, 4),  # ... over the first 300 tokens of a 2000-token prompt
    (600, JUMPY, 6),  # PLNP 0.3: the golden zone starts at 6
    (900, FLAT_UNSURE, 7),  # the middle, a flat slope: 7
    (900, CERTAIN, 8),  # highly certain stretches: flat slope and top-3 entropy < 0.85: 8
    (1400, CERTAIN, 8),  # PLNP 0.7 still inside
    (1401, CERTAIN, 3),  # beyond 0.7 the window shrinks to 3
])
def test_dwc_seed_worked_example(generated, signals, want):
    assert DynamicWindow().window(_view(generated, **signals)) == want


def test_dwc_caps_and_bounds():
    dwc = DynamicWindow(WindowConfig(min_window=2))
    assert dwc.window(_view(900, cap=5, **CERTAIN)) == 5  # tenant/request/RAS cap
    assert dwc.window(_view(1500, cap=1, **CERTAIN)) == 2  # min_window is a floor


def test_dwc_degrade_mode_and_recovery():
    dwc = DynamicWindow()
    v = _view(900, **CERTAIN)
    for _ in range(3):  # half rejected each round: EWMA (2/11) 0.09, 0.17, 0.23
        dwc.observe(_view(900, window=4, accepted=2, **CERTAIN))
    assert not dwc.states[0].degraded
    dwc.observe(_view(900, window=4, accepted=2, **CERTAIN))  # 0.28 > 0.25
    assert dwc.states[0].degraded and dwc.window(v) == 2
    for i in range(4):  # a rejection resets the count of clean rounds
        dwc.observe(_view(900, window=2, accepted=2 if i != 2 else 1, **CERTAIN))
    assert dwc.states[0].degraded
    for _ in range(5):
        dwc.observe(_view(900, window=2, accepted=2, **CERTAIN))
    assert not dwc.states[0].degraded and dwc.window(v) == 8


def test_policy_registry():
    assert make_policy("fixed", window=3).window(_view(10)) == 3
    with pytest.raises(DSparkError, match="unknown window policy 'nope' .*dflash, fixed, goodput"):
        make_policy("nope")


def _costs():
    costs = CostModel()
    for tokens, ms in ((1, 20), (2, 21), (4, 23), (8, 28), (16, 38), (32, 60), (64, 105)):
        costs.record("main", tokens, ms / 1000)
    for tokens, ms in ((1, 10), (2, 10.5), (4, 11.5), (8, 14), (16, 20), (32, 32)):
        costs.record("draft", tokens, ms / 1000)
    return costs


def test_cost_table_keeps_a_verify_window_as_measured():
    """A 3-token verify that costs 21.5 ms is not recorded as 2/3 of it in the 2-token row
    (it once priced a 3-token verify below a 1-token decode); prefill sizes still bucket."""
    costs = CostModel()
    for tokens, ms in ((1, 19.5), (3, 21.5), (5, 23.0), (100, 400.0)):
        costs.record("main", tokens, ms / 1000)
    assert costs.seconds("main", 3) == pytest.approx(0.0215)
    assert costs.seconds("main", 1) < costs.seconds("main", 2) < costs.seconds("main", 3)
    assert costs.seconds("main", 2) == pytest.approx(0.0205)
    assert costs.seconds("main", 4) == pytest.approx(0.02225)
    assert costs.seconds("main", 64) == pytest.approx(0.256)  # 100 tokens scaled into 64's
    assert costs.after_draft(3) == costs.seconds("main", 3)  # nothing measured after drafts
    costs.record(AFTER_DRAFT, 3, 0.0222)
    assert costs.after_draft(3) == pytest.approx(0.0222)
    assert costs.after_draft(2) == pytest.approx(0.0222)  # below its smallest: that one
    assert costs.after_draft(5) == costs.seconds("main", 5)  # not extrapolated past it


def test_goodput_selects_slots_by_survival():
    costs = _costs()
    # nearly sure drafts are all worth verifying; improbable ones are not
    assert select_slots([[0.95, 0.9, 0.86, 0.8]], 1, costs) == [4]
    assert select_slots([[0.05, 0.01]], 1, costs) == [0]
    keep = select_slots([[0.9, 0.8, 0.7], [0.3, 0.1, 0.05], [0.99, 0.98, 0.97]], 3, costs)
    assert keep[2] == 3 and keep[0] >= keep[1]


def test_goodput_stops_drafting_when_it_does_not_pay():
    policy = make_policy("goodput", costs=_costs())
    sure = _view(50, prompt=100, top1=(0.95, 0.95, 0.95))
    unsure = _view(50, prompt=100, top1=(0.2, 0.2, 0.2))
    assert policy.keep_drafting(sure, 3) and not policy.keep_drafting(unsure, 2)
    low = _view(50, prompt=100, window=4, accepted=0, top1=(0.1,) * 4)
    low.stats.draft_tokens = 40  # a history of near-zero acceptance
    windows = [policy.window(low) for _ in range(10)]
    assert windows[:8] == [0] * 8 and windows[8] == 8  # plain, but re-measures every 8 rounds


def test_vlb_lanes_follow_utilisation():
    costs = _costs()
    vlb = VerifyBalancer(VerifyBalanceConfig(steady_tokens_low=2, steady_tokens_mid=1), costs)
    vlb.observe(1, 0.02)  # one request: the verify streams weights, tokens are nearly free
    assert vlb.utilisation < 0.6 and vlb.admit(0) == 0 and vlb.admit(6) == 3
    vlb.observe(63, 0.1)  # a big verify is compute-bound: each token costs its share
    assert vlb.utilisation > 0.85 and vlb.admit(6) == 1  # fast lane only, the rest held
    vlb.config = VerifyBalanceConfig(low_utilisation=0.1, high_utilisation=1.0)
    assert vlb.admit(6) == 3  # mid utilisation: fast lane + steady_tokens_mid (2)


def test_vlb_utilisation_is_not_one_noisy_neighbour():
    """One slow 4-token entry beside a 3-token one is noise, not a compute-bound verify:
    the steady lane stays open."""
    costs = CostModel()
    for tokens, ms in ((1, 19.5), (2, 20.3), (3, 21.0), (4, 30.0), (5, 23.0), (8, 26.0)):
        costs.record("main", tokens, ms / 1000)
    vlb = VerifyBalancer(VerifyBalanceConfig(), costs)
    vlb.observe(3, 0.021)
    assert vlb.utilisation < 0.6 and vlb.admit(4) == 4


def test_vlb_batch_cap_sizes_the_window_and_leaves_off_to_the_batch_modes():
    """The cap is the window with the most tokens per second at the batch's size, never 0:
    whether a batch speculates is measured (batch modes), and a cap of 0 stopped the
    model's rounds and with them the acceptance the cap is priced from."""
    costs = _costs()
    costs.per_seq["main"] = 0.002
    costs.per_seq["draft"] = 0.002
    vlb = VerifyBalancer(VerifyBalanceConfig(), costs)
    assert vlb.batch_cap(1, 6) == 6  # one request: the window policy decides
    assert vlb.batch_cap(4, 0) == 0
    vlb.acceptance = 0.9
    assert vlb.batch_cap(2, 6) >= 2  # two requests, likely drafts: a longer window
    assert vlb.batch_cap(32, 6) == 1  # many requests: the least window, modes decide
    vlb.acceptance = 0.05
    assert vlb.batch_cap(2, 6) == 1  # drafts that rarely hold: the least window
    for _ in range(60):  # ... which keeps measuring them: once they hold, it widens
        vlb.observe_round(True)
    assert vlb.batch_cap(2, 6) >= 2


def _run_modes(modes: BatchModes, steps: int, rate: dict[bool, float], batch: int = 16
               ) -> list[bool]:
    """`steps` steps of `batch` sequences whose mode yields `rate[mode]` tokens a second."""
    chosen = []
    for _ in range(steps):
        mode = modes.speculate(batch)
        chosen.append(mode)
        modes.observe(batch, mode, batch, batch / rate[mode])
    return chosen


def test_batch_modes_follow_the_faster_mode_and_explore_at_a_bounded_cost():
    modes = BatchModes(explore_every=24)
    chosen = _run_modes(modes, 400, {True: 200.0, False: 300.0})
    first = MIN_STEPS + SETTLE_STEPS  # each mode's first step after the other: not measured
    assert chosen[:2 * first] == [True] * first + [False] * first
    late = chosen[100:]
    assert 0 < late.count(True) <= len(late) / 24 * (300 / 200) + TRIAL_STEPS  # trials
    assert "".join("TP"[not m] for m in late).strip("P").count("PT") < late.count(True) / 2
    # the load changes: speculation becomes the faster mode, and the trials find it
    chosen = _run_modes(modes, 400, {True: 500.0, False: 300.0})
    assert chosen[-100:].count(True) > 90


def test_a_switchs_one_off_work_does_not_count_against_the_mode():
    """Speculation's first step after plain ones yields one token a sequence and lasts long
    (its draft catching up); its own steps, once acceptance picks up after the first 100,
    yield 4.5 a sequence: 2x plain's tokens a second. Measured badly at first, it is tried
    again in trials of several steps with the first left out, and found; measured one step
    at a time, each trial would be a catch-up alone and plain would keep winning."""
    modes, chosen, batch, last = BatchModes(explore_every=24), [], 4, None
    for step in range(2000):
        mode = modes.speculate(batch)
        tokens, seconds = (batch * (4.5 if step >= 100 else 1), 0.09) if mode else (batch, 0.04)
        if mode and last is False:
            tokens, seconds = batch, 0.12  # the switch: a catch-up, one token each
        modes.observe(batch, mode, tokens, seconds)
        chosen.append(mode)
        last = mode
    assert chosen[50:100].count(False) > 40  # plain first, while speculation paid less
    assert chosen[-300:].count(True) > 0.85 * 300  # then speculation, trials of plain aside
    assert modes.summary()["4"]["speculative"] == pytest.approx(200.0)


def test_a_step_after_an_idle_spell_is_not_measured():
    modes = BatchModes()
    for idle in (False, True, False):
        for _ in range(SETTLE_STEPS + MIN_STEPS):
            modes.observe(4, False, 4, 0.04 if not idle else 4.0, after_idle=idle)
    assert modes.summary()["4"]["plain"] == pytest.approx(100.0)


def test_batch_modes_keep_one_sequence_and_each_bucket_apart():
    modes = BatchModes()
    assert modes.speculate(1) and all(modes.speculate(1) for _ in range(10))
    _run_modes(modes, 200, {True: 100.0, False: 300.0}, batch=16)
    _run_modes(modes, 200, {True: 300.0, False: 100.0}, batch=3)
    assert not modes.speculate(12)  # 9-16 learned plain; 3-4 learned speculation
    assert modes.speculate(4)
    assert set(modes.summary()) == {"16", "4"}


def test_vlb_speculate_obeys_the_config_switch():
    balancer = VerifyBalancer(VerifyBalanceConfig(batch_modes=False), _costs())
    for mode, seconds in ((True, 1.0), (False, 0.01)):
        for _ in range(50):
            balancer.observe_step(16, mode, 16, seconds)
    assert balancer.speculate(16)
    balancer.configure(DFlashConfig(verify_balance=VerifyBalanceConfig(batch_modes=True)))
    assert not balancer.speculate(16)  # measured: plain steps are 100x faster


def test_che_seed_example_restores_health(arena):  # noqa: F811
    """A finished sequence leaves a hole; three consecutive rejections leave slack."""
    che = CacheHealth(arena, CacheHealthConfig())
    for s, tokens in enumerate((32, 64, 20)):  # blocks 0-1, 2-5, 6-7
        arena.add_sequence(s)
        arena.reserve(s, "main", 0, tokens)
    arena.release(1)  # blocks 2-5 free: a hole between 0-1 and 6-7
    for _ in range(3):  # three rounds whose 8 drafts were all rejected
        start = arena.tables[2].lengths["main"]
        arena.reserve(2, "main", start, 8 + 16)
        arena.rollback(2, "main", start)
    marker = arena.tables[2].blocks["main"][0]
    arena.pools["main"].k[1][marker].fill_(7.0)
    before = measure(arena)
    assert before.kdr < 0.75 and before.vfi > 0.12, before
    after = che.run()
    assert after.kdr >= 0.75 and after.vfi <= 0.12, after
    moved = arena.tables[2].blocks["main"][0]
    assert moved != marker and torch.all(arena.pools["main"].k[1][moved] == 7.0)
    assert che.compactions == 1 and che.defrag_moves > 0
    assert hit_rate([[3, 4, 5], [9, 2]]) == 0.8  # 2 is the only block off its run


def test_config_reload_keeps_the_running_config_on_errors(tmp_path):
    path = tmp_path / "dflash_config.json"
    path.write_text(json.dumps(DFlashConfig().to_dict()))
    watcher = ConfigWatcher(path, DFlashConfig())
    assert watcher.poll(force=True) is None  # unchanged content
    data = DFlashConfig().to_dict()
    data["window"]["initial"] = 6
    path.write_text(json.dumps(data))
    new = watcher.poll(force=True)
    assert new is not None and new.window.initial == 6 and watcher.reloads["ok"] == 2
    data["window"]["policy"] = "warp"
    path.write_text(json.dumps(data))
    assert watcher.poll(force=True) is None
    assert watcher.reloads["error"] == 1 and "window.policy" in watcher.last_error
    path.write_text("{broken")
    assert watcher.poll(force=True) is None and "not valid JSON" in watcher.last_error
    assert watcher.config.window.initial == 6


@pytest.mark.parametrize("method", ["lookup", "draft"])
def test_health_repairs_do_not_change_output(fixture_pairs, compiled, method):
    """Aggressive CHE (compact and defragment between every step) on a batch whose
    sequences finish at different times: same tokens as the original model. Methods named:
    the hybrid's choices follow measured timings, and so would the arena's fragmentation
    (in a cold process it left nothing to defragment). Without the prefix cache: with it,
    finished sequences' blocks stay cached instead of leaving holes (CHE moves shared and
    cached blocks too: tests/test_prefix_cache.py)."""
    from dspark.compiler.reference import OriginalModel
    from dspark.runtime.bundle.bundle import open_bundle
    from dspark.runtime.engine.engine import Engine
    from dspark.runtime.sequence.request import GenerationRequest

    main, _ = fixture_pairs[("llama", "dynamo")]
    engine = Engine(open_bundle(compiled[("llama", "dynamo")]), "fixed", 8, prefix_cache=False)
    engine.apply_config(DFlashConfig(cache_health=CacheHealthConfig(
        interval_ms=10, kdr_min=1.0, vfi_max=0.0001)))
    engine.health.config = CacheHealthConfig(interval_ms=10, kdr_min=1.0, vfi_max=0.0001)
    engine.health.last_run = -1.0
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (20, 3, 40, 7, 60, 11)]
    lengths = [70, 10, 55, 25, 80, 40]
    original = OriginalModel(main)
    import time

    def step_slowly():  # let CHE's interval pass between steps
        time.sleep(0.011)
        return Engine.step(engine)

    engine.step = step_slowly
    seqs = engine.generate([GenerationRequest(tuple(p), n, method=method)
                            for p, n in zip(prompts, lengths)])
    for p, n, seq in zip(prompts, lengths, seqs):
        assert seq.generated == original.greedy(p, n)
    assert engine.health.defrag_moves > 0 and engine.health.compactions > 0
    assert engine.arena.free_blocks == engine.plan.num_blocks
