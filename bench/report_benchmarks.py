"""Write docs/benchmarks.md from the benchmarks' JSON reports (build/reports/*.json).

    make benchmarks       # runs every benchmark below into build/reports/, then this
    python bench/report_benchmarks.py [--reports build/reports] [--out docs/benchmarks.md]

The page holds the current figures only, each table under the command that made it, the CPU
it ran on and the revision it measured. A report that is missing keeps the page's section as
it stands (a partial rerun erases nothing), or reads "not run". Old figures live in git. The
README's results summary (between its RESULTS markers) is rewritten from the greedy peer run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmark_reports import REPORTS

ROOT = Path(__file__).resolve().parent.parent


def _x(v) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def peers_table(report: dict) -> list[str]:
    out = ["| class | system | tok/s | own plain | dsrun fp32 plain | best genai | "
           "best llama.cpp | same |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        band = r.get("vs_own_plain_90")
        own = _x(r["vs_own_plain"]) + (f" ({band[0]:.2f}-{band[1]:.2f})" if band else "")
        same = {True: "yes", False: "NO", None: "-"}[r["same_as_own_plain"]]
        out.append(f"| {r['class']} | {r['system']} | {r['tps']:.1f} | {own} | "
                   f"{_x(r['vs_dsrun_fp32_plain'])} | {_x(r['vs_best_genai'])} | "
                   f"{_x(r['vs_best_llama'])} | {same} |")
    return out


def int4_table(report: dict) -> list[str]:
    variants = list(report["rows"][0]["us"])
    out = ["| projection | rows | " + " | ".join(variants) + " |",
           "|---|---|" + "---|" * len(variants)]
    for r in report["rows"]:
        base = r["us"]["MatMulNBits symmetric"]
        cells = [f"{r['us'][v]:.0f} ({r['us'][v] / base:.2f}x)" if v in r["us"] else "-"
                 for v in variants]
        out.append(f"| {r['projection']} {r['k']}x{r['n']} {r['bits']}-bit | {r['rows']} | "
                   + " | ".join(cells) + " |")
    return out


def bench_table(report: dict) -> list[str]:
    out = ["| class | plain tok/s | speculative tok/s | speed-up | accepted | c (draft/main) | "
           "same |", "|---|---|---|---|---|---|---|"]
    for r in report["classes"]:
        out.append(f"| {r['class']} | {r['tps_plain']:.1f} | {r['tps_spec']:.1f} | "
                   f"{r['speedup']:.2f}x | {r['acceptance_rate']:.2f} | {r['c']:.2f} | "
                   f"{'yes' if r['identical'] else 'NO'} |")
    return out


def multi_turn_table(report: dict) -> list[str]:
    from bench_multi_turn import table

    return [report["setup"], "", *table(report)]


def prefix_lookup_table(report: dict) -> list[str]:
    from bench_prefix_lookup import table

    return table(report)


def kv_bytes_table(report: dict) -> list[str]:
    from kv_bytes import table

    return [report["setup"], "", *table(report)]


def serving_table(report: dict) -> list[str]:
    from bench_serving import table

    return [report["setup"], "", *table(report)]


def roofline_table(report: dict) -> list[str]:
    from bench_roofline import table

    return table(report)


def processors_table(report: dict) -> list[str]:
    from bench_processors import table

    return [report["setup"], "", *table(report)]


def big_table(report: dict) -> list[str]:
    from bench_big import table

    return table(report)


TABLES = {"big.json": big_table, "peers_greedy.json": peers_table,
          "peers_sampled.json": peers_table,
          "peers_loaded.json": peers_table, "peers_avx2.json": peers_table,
          "peers_loaded_avx2.json": peers_table, "peers_loaded_one.json": peers_table,
          "peers_loaded_avx2_one.json": peers_table, "peers_quiet_one.json": peers_table,
          "peers_avx2_one.json": peers_table, "peers_int4off.json": peers_table,
          "peers_gemma3.json": peers_table,
          "peers_optimum.json": peers_table, "peers_threads_loaded.json": peers_table,
          "peers_threads.json": peers_table, "peers_threads_auto.json": peers_table,
          "peers_threads_adaptive_loaded.json": peers_table,
          "peers_threads_fixed_loaded.json": peers_table,
          "peers_threads_adaptive.json": peers_table,
          "int4_kernels.json": int4_table, "gemma3_bench.json": bench_table,
          "q4_bench.json": bench_table, "q4_bench_loaded.json": bench_table,
          "q4_bench_avx2.json": bench_table, "q4_bench_avx2_loaded.json": bench_table,
          "q8_bench.json": bench_table, "multi_turn.json": multi_turn_table,
          "prefix_lookup.json": prefix_lookup_table, "kv_bytes_gemma3.json": kv_bytes_table,
          "processors.json": processors_table, "serving.json": serving_table,
          "roofline.json": roofline_table}


def sections(page: str) -> dict[str, list[str]]:
    """The body of each `## heading` section of a page written by render()."""
    found, heading = {}, None
    for line in page.splitlines():
        if line.startswith("## "):
            heading = line[3:]
            found[heading] = []
        elif heading is not None:
            found[heading].append(line)
    return found


def render(folder: Path, current: str = "") -> str:
    """The page from the reports in `folder`; `current`: the page as it stands, whose
    sections stay where their report is missing."""
    kept = sections(current)
    lines = ["# Benchmarks", "",
             "Current figures, written by `bench/report_benchmarks.py` from the JSON the "
             "benchmarks below write (`make benchmarks` runs them all). Only ratios measured "
             "in one run mean anything: each table comes from one interleaved run on the CPU "
             "named under it. Users' CPUs differ; a path this one lacks is unmeasured.", ""]
    for name, heading, command, what in REPORTS:
        lines += [f"## {heading}", "", "    " + command, ""]
        path = folder / name
        if not path.exists():
            old = kept.get(heading, [])[3:]  # past the command and its blank lines
            lines += old if any(line.startswith("|") for line in old) else [
                "Not run for this page.", ""]
            continue
        report = json.loads(path.read_text())
        measured = f"measured at {report['revision']}" if report.get("revision") else (
            "revision not recorded")
        lines += [what, "", f"{report.get('cpu', 'CPU not recorded')}; {measured}", ""]
        lines += TABLES[name](report) + [""]
    return "\n".join(lines)


SUMMARY = [("dsrun, fp32 main + int4 draft", "dsrun-fp32-default"),
           ("llama.cpp, F32 GGUF, best lossless mode", "llama-f32-*"),
           ("onnxruntime-genai, fp32, best mode", "genai-fp32-*"),
           ("dsrun, genai's int4 build", "dsrun-genai4-default"),
           ("onnxruntime-genai, int4", "genai-int4-plain"),
           ("llama.cpp, Q4_1 GGUF, best lossless mode", "llama-q4_1-*")]
START, END = "<!-- RESULTS -->", "<!-- /RESULTS -->"


def summary(report: dict) -> list[str]:
    """tok/s per class of SUMMARY's systems (a * takes the fastest lossless mode)."""
    classes = sorted({r["class"] for r in report["rows"]})
    out = ["| SmolLM2-135M, 128 new tokens, greedy | " + " | ".join(classes) + " |",
           "|---|" + "---|" * len(classes)]
    for label, pattern in SUMMARY:
        cells = []
        for cls in classes:
            rows = [r for r in report["rows"] if r["class"] == cls
                    and (r["system"] == pattern or pattern.endswith("*")
                         and r["system"].startswith(pattern[:-1])
                         and r["same_as_own_plain"] is not False)]
            cells.append(f"{max(r['tps'] for r in rows):.0f} tok/s" if rows else "-")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out + ["", report["cpu"] + ". Every table, with the commands: "
                  "[docs/benchmarks.md](docs/benchmarks.md)."]


def rewrite_readme(readme: Path, report_path: Path) -> bool:
    text = readme.read_text()
    if not report_path.exists() or START not in text or END not in text:
        return False
    head, rest = text.split(START, 1)
    body = "\n".join(summary(json.loads(report_path.read_text())))
    tmp = readme.with_suffix(".tmp")
    tmp.write_text(f"{head}{START}\n{body}\n{END}{rest.split(END, 1)[1]}")
    tmp.rename(readme)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reports", type=Path, default=ROOT / "build" / "reports")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = p.parse_args()
    tmp = args.out.with_suffix(".tmp")
    current = args.out.read_text() if args.out.exists() else ""
    tmp.write_text(render(args.reports, current))
    tmp.rename(args.out)
    print(f"wrote {args.out}")
    if rewrite_readme(ROOT / "README.md", args.reports / "peers_greedy.json"):
        print("rewrote the README's results")


if __name__ == "__main__":
    main()
