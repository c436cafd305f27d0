"""`dsrun bench`: speculative against plain decoding, same prompts, interleaved, one process.

For each prompt class it reports tokens/s per mode (median of repeats), the speed-up, the
acceptance rate, alpha (solved from mean tokens per round: E = (1 - a^(w+1)) / (1 - a)),
the draft/main cost ratio c (one draft forward over one plain main decode forward), the
Leviathan bound (1 - a^(w+1)) / ((1 - a)(w c + 1)) and measured/bound. The bound assumes a
verify forward of w+1 tokens costs one decode step; on a CPU it costs v > 1 (measured and
shown), so the report also gives the bound with that cost, (1 - a^(w+1)) / ((1 - a)(w c + v)),
which is what is left for the engine's own overhead to lose.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dspark.runtime.engine.engine import Engine
from dspark.runtime.errors import DSparkError
from dspark.runtime.model.device import cpu_line
from dspark.runtime.sequence.prompt import entry_ids
from dspark.runtime.sequence.request import GenerationRequest


@contextlib.contextmanager
def busy_core(on: bool):
    """While inside, another process spins on one core (`--background-load`): the engine
    measures its costs under that load, as on a machine busy with other work."""
    if not on:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def solve_alpha(tokens_per_round: float, w: int) -> float:
    """a with (1 - a^(w+1)) / (1 - a) == tokens_per_round (bisection)."""
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(60):
        a = (lo + hi) / 2
        if (1 - a ** (w + 1)) / (1 - a) < tokens_per_round:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def leviathan_bound(alpha: float, w: int, c: float, verify: float = 1.0) -> float:
    """Expected speed-up: tokens per round over the round's cost in main decode steps."""
    return (1 - alpha ** (w + 1)) / ((1 - alpha) * (w * c + verify))


def _counters(engine: Engine) -> tuple[float, int, float, int]:
    draft = engine.draft_model
    return (engine.main.busy_s, engine.main.forwards, draft.busy_s if draft else 0.0,
            draft.forwards if draft else 0)


def _one(engine: Engine, ids: list[int], max_tokens: int, spec: bool,
         method: str | None = None) -> dict:
    before = _counters(engine)
    t0 = time.perf_counter()
    # every run computes its prompt: decoding speed is compared, not prefix reuse
    [seq] = engine.generate([GenerationRequest(tuple(ids), max_tokens, speculative=spec,
                                               method=method, cache_prompt=False)])
    elapsed = time.perf_counter() - t0
    d = [b - a for a, b in zip(before, _counters(engine))]
    return {"tokens": seq.generated, "seconds": elapsed, "tps": len(seq.generated) / elapsed,
            "rounds": seq.stats.rounds, "drafted": seq.stats.draft_tokens,
            "accepted": seq.stats.accepted_tokens, "main_s": d[0], "main_forwards": d[1],
            "draft_s": d[2], "draft_forwards": d[3], "stats": seq.stats.summary()}


def run_bench(engine: Engine, tokenizer, prompts: list[dict], max_tokens: int,
              repeats: int, method: str | None = None) -> dict:
    w = engine.planner.fixed_window
    ids = {p["name"]: entry_ids(tokenizer, p) for p in prompts}
    first = next(iter(ids.values()))
    _one(engine, first, 8, True)  # warm-up: sessions' first runs, allocations
    _one(engine, first, 8, False)
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(repeats):
        for p in prompts:
            for mode in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                runs.setdefault((p["name"], mode), []).append(
                    _one(engine, ids[p["name"]], max_tokens, mode == "spec", method))
    per_prompt = [_summarise([runs[(p["name"], m)] for m in ("plain", "spec")], w,
                             name=p["name"], cls=p["class"]) for p in prompts]
    classes = sorted({p["class"] for p in prompts})
    per_class = [_summarise([[x for p in prompts if p["class"] == c for x in runs[(p["name"], m)]]
                             for m in ("plain", "spec")], w, name=c, cls=c) for c in classes]
    return {"cpu": cpu_line(), "window": w, "policy": engine.planner.policy_name,
            "max_tokens": max_tokens,
            "repeats": repeats, "prompts": per_prompt, "classes": per_class}


METHOD_MODES = ("lookup", "hybrid", "draft")

Mode = tuple[str, str | None, int | None, str | None]  # label, policy, window, method


def parse_modes(text: str) -> list[Mode]:
    """"plain,fixed:1-8,dflash,goodput,lookup,hybrid" -> [(label, policy, window, method)],
    plain first. A policy mode drafts with the draft model alone under that policy; a
    method mode (lookup, hybrid, draft) uses the config's policy."""
    modes: list[Mode] = [("plain", None, None, None)]
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, _, arg = item.partition(":")
        if name == "plain":
            continue
        if name in METHOD_MODES:
            modes.append((item, None, None, name))
        elif name == "fixed" and arg:
            lo, _, hi = arg.partition("-")
            try:
                windows = range(int(lo), int(hi or lo) + 1)
            except ValueError:
                raise DSparkError(f"--policies: bad window range {arg!r} in {item!r}") from None
            modes += [(f"fixed:{w}", "fixed", w, "draft") for w in windows]
        else:
            modes.append((item, name, int(arg) if arg.isdigit() else None, "draft"))
    return modes


def _use(engine: Engine, policy: str | None, window: int | None) -> None:
    """fixed:N is window N, above the device cap too; method modes use the config's policy."""
    engine.planner.set_policy(policy or engine.config.window.policy, window,
                              device_cap=policy != "fixed")


def run_sweep(engine: Engine, tokenizer, prompts: list[dict], max_tokens: int, repeats: int,
              modes: list[Mode]) -> dict:
    """Every prompt under every mode, modes rotated per repeat; medians per class and mode."""
    ids = {p["name"]: entry_ids(tokenizer, p) for p in prompts}
    for _, policy, window, _ in modes:
        _use(engine, policy, window)  # unknown names fail before anything runs
    _one(engine, next(iter(ids.values())), 8, True)
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(repeats):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for p in prompts:
            for label, policy, window, method in order:
                _use(engine, policy, window)
                runs.setdefault((p["name"], label), []).append(
                    _one(engine, ids[p["name"]], max_tokens, label != "plain", method))
    rows = []
    for cls in sorted({p["class"] for p in prompts}):
        names = [p["name"] for p in prompts if p["class"] == cls]
        plain = statistics.median(x["tps"] for n in names for x in runs[(n, "plain")])
        for label, *_ in modes:
            rows.append(_sweep_row(cls, label, [x for n in names for x in runs[(n, label)]],
                                   plain, [runs[(n, "plain")] for n in names],
                                   [runs[(n, label)] for n in names]))
    return {"cpu": cpu_line(), "max_tokens": max_tokens, "repeats": repeats, "sweep": rows}


def _sweep_row(cls: str, label: str, xs: list[dict], plain_tps: float,
               plain_runs: list[list[dict]], mode_runs: list[list[dict]]) -> dict:
    drafted, rounds = sum(x["drafted"] for x in xs), sum(x["rounds"] for x in xs)
    tps = statistics.median(x["tps"] for x in xs)
    methods: dict[str, int] = {}
    for x in xs:
        for m, n in x["stats"]["methods"].items():
            methods[m] = methods.get(m, 0) + n
    return {"class": cls, "mode": label, "tps": tps, "speedup": tps / plain_tps,
            "acceptance_rate": sum(x["accepted"] for x in xs) / drafted if drafted else 0.0,
            "mean_window": drafted / rounds if rounds else 0.0,
            "tokens_per_forward": sum(len(x["tokens"]) for x in xs) / max(
                1, sum(x["main_forwards"] for x in xs)),
            "methods": methods,
            "identical": all(x["tokens"] == y["tokens"] for a, b in zip(mode_runs, plain_runs)
                             for x, y in zip(a, b))}


def format_sweep(report: dict) -> str:
    lines = [report["cpu"], f"{report['max_tokens']} tokens, median of {report['repeats']} "
             "rotated runs",
             f"{'class':<6}{'mode':<11}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'window':>8}"
             f"{'tok/fwd':>8}  same  rounds by source"]
    for row in report["sweep"]:
        methods = " ".join(f"{m}:{n}" for m, n in sorted(row["methods"].items()))
        lines.append(f"{row['class']:<6}{row['mode']:<11}{row['tps']:>8.1f}{row['speedup']:>8.2f}x"
                     f"{row['acceptance_rate']:>8.2f}{row['mean_window']:>8.2f}"
                     f"{row['tokens_per_forward']:>8.2f}  {'yes ' if row['identical'] else 'NO  '}"
                     f"  {methods}")
    return "\n".join(lines)


def _summarise(modes: list[list[dict]], w: int, name: str, cls: str) -> dict:
    plain, spec = modes
    rounds = sum(x["rounds"] for x in spec)
    drafted, accepted = sum(x["drafted"] for x in spec), sum(x["accepted"] for x in spec)
    per_round = (accepted + rounds) / rounds if rounds else 1.0
    w = drafted / rounds if rounds else w  # verified per round (VLB may hold some back)
    alpha = solve_alpha(per_round, w) if w else 0.0
    main_step = sum(x["main_s"] for x in plain) / max(1, sum(x["main_forwards"] for x in plain))
    draft_step = sum(x["draft_s"] for x in spec) / max(1, sum(x["draft_forwards"] for x in spec))
    verify_step = sum(x["main_s"] for x in spec) / max(1, sum(x["main_forwards"] for x in spec))
    c = draft_step / main_step if main_step else 0.0
    tps = {m: statistics.median(x["tps"] for x in runs)
           for m, runs in zip(("plain", "spec"), modes)}
    speedup = tps["spec"] / tps["plain"]
    v = verify_step / main_step if main_step else 1.0
    bound = leviathan_bound(alpha, w, c) if w else 1.0
    bound_v = leviathan_bound(alpha, w, c, v) if w else 1.0
    return {
        "name": name, "class": cls, "tps_plain": tps["plain"], "tps_spec": tps["spec"],
        "speedup": speedup, "acceptance_rate": accepted / drafted if drafted else 0.0,
        "alpha": alpha, "mean_accepted_per_round": accepted / rounds if rounds else 0.0,
        "c": c, "verify_over_decode": v, "bound": bound, "measured_over_bound": speedup / bound,
        "bound_at_verify_cost": bound_v, "measured_over_bound_at_verify_cost": speedup / bound_v,
        "identical": all(a["tokens"] == b["tokens"] for a, b in zip(plain, spec)),
    }


def format_report(report: dict) -> str:
    head = (f"{'prompt':<12}{'class':<6}{'plain t/s':>10}{'spec t/s':>10}{'speedup':>9}"
            f"{'accept':>8}{'alpha':>7}{'acc/rnd':>8}{'c':>6}{'verify/dec':>11}{'bound':>7}"
            f"{'meas/bound':>11}{'bound(v)':>9}{'meas/b(v)':>10}  same")
    lines = [report["cpu"], f"window {report['window']}, {report['max_tokens']} tokens, "
             f"median of {report['repeats']} interleaved runs", head]
    for row in report["prompts"] + [None] + report["classes"]:
        if row is None:
            lines.append("-" * len(head))
            continue
        lines.append(
            f"{row['name']:<12}{row['class']:<6}{row['tps_plain']:>10.1f}{row['tps_spec']:>10.1f}"
            f"{row['speedup']:>8.2f}x{row['acceptance_rate']:>8.2f}{row['alpha']:>7.2f}"
            f"{row['mean_accepted_per_round']:>8.2f}{row['c']:>6.2f}"
            f"{row['verify_over_decode']:>11.2f}{row['bound']:>7.2f}"
            f"{row['measured_over_bound']:>11.2f}{row['bound_at_verify_cost']:>9.2f}"
            f"{row['measured_over_bound_at_verify_cost']:>10.2f}  "
            f"{'yes' if row['identical'] else 'NO'}")
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DSparkError("--plot needs matplotlib (pip install matplotlib)") from None
    rows = report["prompts"]
    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["tps_plain"] for r in rows], 0.4, label="plain")
    ax1.bar([i + 0.2 for i in x], [r["tps_spec"] for r in rows], 0.4, label="speculative")
    ax1.set_ylabel("tokens/s")
    ax1.legend()
    ax2.bar(list(x), [r["acceptance_rate"] for r in rows], color="tab:green")
    ax2.set_ylabel("draft acceptance rate")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), names, rotation=45, ha="right")
    fig.suptitle(f"dsrun bench: window {report['window']}")
    fig.tight_layout()
    fig.savefig(path)
