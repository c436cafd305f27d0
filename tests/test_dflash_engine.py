"""DFlash inside a running engine: resources (probe, degrade, recover with two drafts),
tenant fairness, and config hot reload, each without changing output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark.compiler.compile import CompileOptions
from dspark.compiler.reference import OriginalModel
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.config import DFlashConfig, ResourceConfig, ResourceRow, TenantConfig
from dspark.runtime.dflash.ras import Device, match_row, probe_device
from dspark.runtime.engine import engine as engine_module
from dspark.runtime.engine.decide import decide
from dspark.runtime.engine.engine import Engine
from dspark.runtime.sequence.request import GenerationRequest

from bundle_cache import compiled


@pytest.fixture(scope="module")
def two_drafts(fixture_pairs, tmp_path_factory):
    """llama main with itself as the big draft and its 1-layer draft as the small one."""
    main, small = fixture_pairs[("llama", "classic")]
    out = tmp_path_factory.mktemp("ras") / "two.dsmodel"
    return compiled(CompileOptions(main, main, out, kv_budget_mb=1, max_seq_len=160,
                                   extra_drafts=(("small", small),))), main


def test_probe_and_table():
    device = probe_device()
    assert device.kind in ("cpu", "cuda") and device.cores >= 1 and device.name
    cfg = ResourceConfig()
    assert match_row(cfg, Device("cuda", "NVIDIA A100-SXM4-40GB", 40, 108)).window == 6
    assert match_row(cfg, Device("cuda", "NVIDIA H100 80GB HBM3", 80, 132)).window == 8
    assert match_row(cfg, Device("cuda", "NVIDIA A10G", 24, 80)).window == 4
    assert match_row(cfg, Device("cpu", "AMD EPYC", 64, 2)).match == "cpu"


def test_extra_draft_is_bundled(two_drafts):
    bundle = open_bundle(two_drafts[0])
    assert set(bundle.models) == {"main", "draft", "draft_small"}
    assert {p.role for p in bundle.plan.pools} == {"main", "draft", "draft_small"}
    assert bundle.draft_models["draft_small"] < bundle.draft_models["draft"]


def test_ras_degrades_and_recovers_without_failing_requests(two_drafts):
    path, main = two_drafts
    # degrade_after_s 0: the switch follows the arena's use step by step, with no wall-clock
    # dependence (the debounce itself is test_ras_debounces_on_the_clock_it_is_given)
    config = DFlashConfig(resources=ResourceConfig(
        table=(ResourceRow("cpu", 8),), degrade_usage=0.3, degrade_after_s=0.0))
    engine = Engine(open_bundle(path), "fixed", 8, config=config, max_batch=8)
    assert engine.draft_model.role == "draft" and engine.resources.window_cap == 16
    original = OriginalModel(main)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 320, 20)] for _ in range(6)]
    seqs = [engine.submit(GenerationRequest(tuple(p), 100, method="draft")) for p in prompts]
    modes = []
    while engine.busy:
        engine.step()
        modes.append((engine.resources.degraded, engine.draft_model.role,
                      engine.resources.window_cap, engine.arena.delta_log))
    assert (True, "draft_small", 6, False) in modes  # degraded: small draft, cap 6, no log
    for p, seq in zip(prompts, seqs):
        assert seq.generated == original.greedy(p, 100)
    light = engine.submit(GenerationRequest((1, 2, 3), 40, method="draft"))
    while engine.busy:
        engine.step()
    engine.maintain()  # the tick after the last step sees the emptied arena
    assert not engine.resources.degraded and engine.draft_model.role == "draft"  # recovered
    assert light.generated == original.greedy([1, 2, 3], 40)
    assert engine.resources.switches >= 2


def test_ras_debounces_on_the_clock_it_is_given():
    """Use past the threshold must last degrade_after_s before the mode flips, either way."""
    from dspark.runtime.dflash.ras import Device, ResourceManager

    config = ResourceConfig(table=(ResourceRow("cpu", 8),), degrade_usage=0.5,
                            degrade_after_s=10.0)
    ras = ResourceManager(config, Device("cpu", "cpu", 24.0, 2), {"draft": 2, "draft_small": 1})
    assert not ras.tick(0.0, 0.9) and not ras.tick(9.9, 0.9)  # pressed, not long enough
    assert ras.tick(10.0, 0.9) and ras.degraded and ras.draft == "draft_small"
    assert not ras.tick(11.0, 0.1) and not ras.tick(15.0, 0.9)  # a dip resets the clock
    assert not ras.tick(16.0, 0.1) and ras.tick(26.0, 0.1) and not ras.degraded
    assert ras.switches == 2


def test_short_tenant_is_not_starved_by_long_prompts(compiled):
    """The seed's case: one tenant sends long prompts, another short ones. Prompts are fed
    in chunks, shortest remaining first, so the short tenant's first tokens come after as
    many engine steps as when it is alone; the long prompts still finish (aging)."""
    config = DFlashConfig(tenants=(TenantConfig("big", 8, 1.0), TenantConfig("small", 4, 1.0)))
    bundle = open_bundle(compiled[("llama", "classic")])

    def first_token_steps(with_big: bool) -> tuple[list[int], list]:
        engine = Engine(bundle, "fixed", 4, config=config, prefill_tokens=64, max_batch=8)
        big = [engine.submit(GenerationRequest(tuple([7 + i] * 420), 16, tenant="big"))
               for i in range(3 if with_big else 0)]
        if with_big:
            engine.step()  # the long prompts are already being fed
        start = engine.scheduler.steps
        small = [engine.submit(GenerationRequest((5, 6, 7, 8) * 12, 8, tenant="small"))
                 for _ in range(3)]
        while engine.busy:
            engine.step()
        assert all(s.finish_reason == "length" for s in big + small)
        return [s.first_token_step - start for s in small], big

    alone, _ = first_token_steps(False)
    shared, big = first_token_steps(True)
    assert shared == alone, (alone, shared)
    assert all(len(b.generated) == 16 for b in big)


def test_config_hot_reload_under_a_running_engine(compiled, fixture_pairs, tmp_path):
    bundle = open_bundle(compiled[("gpt2", "dynamo")])
    path = tmp_path / "dflash_config.json"
    path.write_text(json.dumps(bundle.config.to_dict()))
    engine = Engine(bundle, "dflash")
    watcher = engine.watch(path)
    seq = engine.submit(GenerationRequest((1, 2, 3), 60, method="draft"))
    for _ in range(5):
        engine.step()
    data = bundle.config.to_dict()
    data["window"].update(max_window=2, initial=2)
    path.write_text(json.dumps(data))
    watcher.requested = True  # as SIGHUP does; mtime polling also sees it
    engine.step()
    assert engine.config.window.max_window == 2 and dict(engine.gauges().reloads)["ok"] == 1
    data["window"]["max_window"] = 99
    path.write_text(json.dumps(data))
    watcher.requested = True
    engine.step()
    assert engine.config.window.max_window == 2 and dict(engine.gauges().reloads)["error"] == 1
    while engine.busy:
        engine.step()
    assert seq.stats.last_window <= 2
    original = OriginalModel(fixture_pairs[("gpt2", "dynamo")][0])
    assert seq.generated == original.greedy([1, 2, 3], 60)


def test_benchmark_can_lift_the_device_window_cap(compiled):
    """RAS caps windows at twice the device row's (4 for this CPU row); a sweep measuring
    fixed:6 lifts that cap and verifies 6 drafts a round; the config's max_window stays."""
    config = DFlashConfig(resources=ResourceConfig(table=(ResourceRow("cpu", 2),)))
    engine = Engine(open_bundle(compiled[("llama", "classic")]), "fixed", 6, config=config)
    request = GenerationRequest((1, 2, 3), 40, method="draft")
    [seq] = engine.generate([request])
    assert len(seq.stats.accepted_at) == 4  # the longest round verified 4 drafts
    engine.planner.set_policy("fixed", 6, device_cap=False)
    [seq] = engine.generate([request])
    assert len(seq.stats.accepted_at) == 6
    engine.planner.set_policy("fixed", 12, device_cap=False)
    [seq] = engine.generate([request])
    assert len(seq.stats.accepted_at) == config.window.max_window


def test_first_and_later_draft_forwards_are_costed_apart(compiled):
    """Every round's first draft forward goes to the "draft" row, the ones after it to
    their own, and the verify after them to the main's after-draft row (SourceChooser prices
    a model window as first + steps + that verify); the prompt stays in "main"."""
    from dspark.runtime.model.costs import AFTER_DRAFT, DRAFT_STEP

    engine = Engine(open_bundle(compiled[("llama", "classic")]), "fixed", 4)
    rows, record = [], engine.costs.record
    engine.costs.record = lambda role, *a: (rows.append(role), record(role, *a))
    engine.generate([GenerationRequest(tuple(range(3, 20)), 24, method="draft")])
    firsts, steps, verifies = (rows.count(r) for r in ("draft", DRAFT_STEP, AFTER_DRAFT))
    assert 0 < firsts == verifies  # one first draft forward per model round, then its verify
    assert steps >= 2 * firsts  # window 4: up to 3 more each round
    assert rows.count("main") >= 1  # the prompt
    assert engine.costs.table[DRAFT_STEP] and engine.costs.table[AFTER_DRAFT]


def test_the_warm_up_prices_verifies_in_both_modes_of_the_load_gate(compiled):
    """Forwards run solo while other processes hold the cores (load_gate.py): the warm-up
    measures the main's verify sizes in that mode too, on forwards that did run solo, and
    leaves the gate as it found it."""
    from dspark.runtime.model.costs import EXACT

    engine = Engine(open_bundle(compiled[("llama", "classic")]), "fixed", 4)
    gate = engine.main.model.gate
    assert gate is not None  # the default: forwards follow the load
    before = engine.main.model.solo_forwards
    engine.warmup(main_sizes=(1, 4, 9, 32), draft_sizes=(1,))
    pool, solo = engine.costs.tables[False]["main"], engine.costs.tables[True]["main"]
    assert engine.costs.measured[True] >= {("main", n) for n in (1, 4, 9)}
    assert ("main", 32) not in engine.costs.measured[True]  # beyond EXACT: the pool's price
    assert solo[32] == pool[32] and 32 > EXACT
    assert engine.main.model.solo_forwards - before == 2 * 3  # allocation runs, then measured
    assert gate.pin is None and not gate.solo


def test_hybrid_floor_follows_how_often_the_drafts_hold(compiled):
    """The whole hybrid_min_window while the draft's tokens hold (>= 85% of the drafts that
    were reached), 4 once they do not; a new sequence starts at the threshold (long)."""
    from dspark.runtime.sequence.request import Sequence

    engine = Engine(open_bundle(compiled[("llama", "classic")]), None, None)
    floor = engine.planner.hybrid_floor
    long = engine.config.drafting.hybrid_min_window
    assert long == 8
    fresh, good, poor = (Sequence(i, GenerationRequest((1, 2, 3), 64)) for i in range(3))
    assert floor(fresh) == long
    for _ in range(10):  # 8 drafts a round: 7 hold, the 8th is rejected
        good.stats.record_sources(["draft"] * 8, 7)
        poor.stats.record_sources(["draft"] * 8, 1)  # the second of each round is rejected
    assert floor(good) == long and floor(poor) == 4
    # drafts past a rejection count as not reached, not as rejected: a long window's tail
    tail = Sequence(3, GenerationRequest((1, 2, 3), 64))
    for _ in range(10):  # 6 of the 7 reached held (0.86), 6 of the 8 verified (0.75)
        tail.stats.record_sources(["draft"] * 8, 6)
    assert floor(tail) == long
    lookup_only = Sequence(4, GenerationRequest((1, 2, 3), 64))
    lookup_only.stats.record_sources(["lookup"] * 8, 0)
    assert floor(lookup_only) == long  # only the draft model's tokens count


def test_hybrid_is_offered_at_least_its_min_window(compiled, monkeypatch):
    """On a device row of 2, DWC's windows are 1-2 after the first rounds (late: 3 scaled by
    2/4; degraded: 2 scaled); a hybrid slot is offered `hybrid_min_window` within the device
    cap (4) instead, and under the fixed policy the window asked for."""
    from dspark.runtime.bundle.config import DraftingConfig

    def offered(policy, window, min_window):
        config = DFlashConfig(resources=ResourceConfig(table=(ResourceRow("cpu", 2),)),
                              drafting=DraftingConfig(hybrid_min_window=min_window))
        engine = Engine(open_bundle(compiled[("llama", "classic")]), policy, window,
                        config=config)
        windows = []

        def record(*args):
            out = decide(*args)
            windows.extend(s.window for s in out if s.method == "hybrid")
            return out

        monkeypatch.setattr(engine_module, "decide", record)
        engine.generate([GenerationRequest((5, 6, 7), 64, method="hybrid")])
        return windows[2:7]  # rounds past the first two, with >= 4 tokens left

    assert max(offered("dflash", None, 0)) <= 2
    assert offered("dflash", None, 4) == [4] * 5
    assert offered("dflash", None, 9) == [4] * 5  # the device cap still holds
    assert max(offered("fixed", 1, 4)) <= 1


def test_vlb_acceptance_counts_the_draft_models_rounds_only(compiled, monkeypatch):
    """VLB's batch cap sizes the model's windows, so the acceptance it prices them with
    counts rounds the model led, not lookup rounds (a lookup that rarely held pulled it
    down until the cap stopped the model in every batch)."""
    engine = Engine(open_bundle(compiled[("llama", "classic")]), None, None)
    counted = []
    monkeypatch.setattr(engine.balancer, "observe_round", counted.append)
    rounds = []
    for i, method in enumerate(("lookup", "lookup", "draft")):
        engine.submit(GenerationRequest((5, 6, 7, 8) * 12 + (i,), 40, method=method))
    while engine.busy:
        rounds += [r for r in engine.step().rounds if r.drafted]
    led = [r.accepted > 0 for r in rounds if r.sources[0] == "draft"]
    assert len(led) < len(rounds), "no lookup-led round: nothing tested"
    assert counted == led


def test_a_rounds_time_calibrates_its_sequences_hybrid_only_where_it_ran_alone(compiled):
    """A batch step's time is every sequence's work: charged to each sequence's own rounds,
    it priced the model at a third of plain's speed after speculating batch steps, so a
    trial of speculation after plain steps drafted nothing. Calibrated alone only."""
    engine = Engine(open_bundle(compiled[("llama", "classic")]), None, None)
    chooser = engine.drafting.chooser

    def decode(seqs: list, steps: int) -> None:
        while not all(s.generated for s in seqs):
            engine.step()
        for _ in range(steps):
            assert {s.id for s in engine.step().advanced} == {s.id for s in seqs}

    alone = engine.submit(GenerationRequest((5, 6, 7, 8) * 8 + (9,), 24, method="hybrid"))
    decode([alone], 4)
    assert chooser.state(alone.id).speed  # calibrated: measured alone
    engine.cancel(alone)
    together = [engine.submit(GenerationRequest((5, 6, 7, 8) * 8 + (i,), 24, method="hybrid"))
                for i in range(2)]
    decode(together, 4)
    assert all(not chooser.state(s.id).speed for s in together)
