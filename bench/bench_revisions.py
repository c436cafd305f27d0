"""The same bundles under an older revision and under this checkout, interleaved: did a change
keep speed and outputs? (bench_peers' driver; each revision's workers in their own process.)

    python bench/bench_revisions.py BASE_REV [--repeats 5] [--temperature 0]
                                      [--systems dsrun-fp32-default ...] [--prompt-file F]
                                      [--background-load]

BASE_REV is checked out once into build/revisions/<rev> (a git worktree); its workers import
dspark from there (PYTHONPATH over a folder of links named as the package maps them), this
checkout's from the installed package. The bundles are this checkout's: a revision whose
bundle reader differs cannot be compared this way. Per system and class: tok/s of each,
new/old, and whether every greedy output is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import bench_peers as bp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compiler", "runtime", "kernels", "templates")  # dspark.<name> -> <name>/
SYSTEMS = ["dsrun-fp32-plain", "dsrun-fp32-default", "dsrun-genai4-plain",
           "dsrun-genai4-default", "dsrun-q4-default"]
OLD = "old:"


def checkout(rev: str) -> Path:
    """A folder to put on PYTHONPATH so that `import dspark` finds `rev`'s code."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = ROOT / "build" / "revisions" / sha
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha],
                       check=True, capture_output=True)
    links = tree.with_name(f"{sha}-path") / "dspark"
    links.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        if not (links / name).exists():
            (links / name).symlink_to(tree / name)
    return links.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--systems", nargs="+", default=SYSTEMS)
    p.add_argument("--prompt-file", type=Path, default=bp.PROMPTS,
                   help="jsonl of name, class, chat (default: the peer prompts)")
    p.add_argument("--background-load", action="store_true",
                   help="keep one core busy with another process throughout")
    args = p.parse_args()
    path = str(checkout(args.base))
    cmd, env = bp.worker_cmd, bp.worker_env
    bp.worker_cmd = lambda s, a: cmd(s.removeprefix(OLD), a)
    bp.worker_env = lambda s, a: ({**env(s[len(OLD):], a), "PYTHONPATH": path}
                                  if s.startswith(OLD) else env(s, a))
    systems = args.systems
    args.systems = [x for s in systems for x in (s, OLD + s)]
    args.peer_hugepages = False
    prompts = bp.prompt_ids(args.prompt_file)
    os.environ["DSPARK_PEER_PROMPTS"] = json.dumps(prompts)
    head = bp.revision()
    runs = bp.drive(args, len(prompts))
    print(bp.cpu_line(args.systems))
    print(f"{head} (new) against {args.base} (old), {args.repeats} repeats, "
          f"temperature {args.temperature}")
    for s in systems:
        for cls in sorted({r["class"] for r in runs[s]}):
            new = [r for r in runs[s] if r["class"] == cls]
            old = [r for r in runs[OLD + s] if r["class"] == cls]
            rate = [sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs)
                    for rs in (new, old)]
            same = all(a["tokens"] == b["tokens"] for a, b in zip(new, old))
            print(f"{s:24s} {cls:5s} new {rate[0]:6.1f}  old {rate[1]:6.1f}  new/old "
                  f"{rate[0] / rate[1]:.3f}  same {same if not args.temperature else '-'}")


if __name__ == "__main__":
    main()
