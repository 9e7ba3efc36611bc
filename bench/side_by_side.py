"""A change against a baseline, timed on one GPU: the baseline's tree, and the table of the two.

Machine-to-machine spread on the lent GPUs (the power cap, clocks) is as large as the changes a
kernel edit makes (5-10% per GEMM between two H200s on the same tree), so a change is timed against
its baseline built and run on the same machine, in alternating rounds. ``bench/side_by_side.sh``
does the device's part; this module prepares the baseline and reads the rounds back:

    python bench/side_by_side.py prepare main          # on your machine: main's tree into .base/
    # carry .base (git-ignored) to the device with .fi, then there:
    bench/side_by_side.sh 2 -- python3 bench/stage_breakdown.py --scheme fp8 --no-peer --models qwen3
    python bench/side_by_side.py table rounds/         # the table (side_by_side.sh prints it too;
                                                       # its rounds come back as $OUT/rounds.tgz)

The bench command must take ``--json FILE`` and write :mod:`bench.stage_breakdown`'s rows (a list
of objects with ``model``, ``T``, ``impl``, ``busy`` and ``stages``, microseconds of device time),
or :mod:`bench.moe_bench`'s table (an object with ``rows`` and ``in_loop``, milliseconds per call
and per layer in the loop for each implementation, compared as "per call" and "in loop", in us).
Rounds are files ``base_<round>.json`` and ``new_<round>.json``; the table gives, per row and
stage (and per layer in the loop, where the rows carry ``--loop`` figures), the medians over rounds
and ``new / base`` with its range over the rounds (each round's new against the same round's base).
``bench/tile_rounds.py`` writes such rounds for two tiles of one GEMM, or two tile caches, in one tree.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence

BASE_DIR = ".base"
SIDES = ("base", "new")
# the rows' quantities compared, in the table's order (those that are zero on both sides are left out);
# "loop busy" and "loop gemm": per layer in the loop of ``stage_breakdown --loop N``; "loop mJ": the
# board's millijoules per layer as that loop ran back to back (the one figure not in microseconds)
# "per call" and "in loop": moe_bench's timers (wall time per call, device time per layer in its loop)
QUANTITIES = ("busy", "gemm1", "gemm2", "permute", "act", "finalize", "sort", "route", "setup", "glue", "loop busy",
              "loop gemm", "loop mJ", "per call", "in loop")
TIMERS = ("per call", "in loop")


def prepare(rev: str, dest: str = BASE_DIR, repo: str = ".") -> str:
    """Writes git revision ``rev``'s tree of ``repo`` to ``dest`` (replacing what is there) and
    returns the commit it resolved to."""
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    if os.path.exists(dest):
        subprocess.run(["rm", "-rf", dest], check=True)
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", repo, "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    with open(os.path.join(dest, "BASE_COMMIT"), "w") as f:
        f.write(commit + "\n")
    return commit


def _quantity(row: dict, name: str) -> float | None:
    """A row's figure (us); None for a loop figure where the run had no loop or its trace was not
    attributed."""
    if name in TIMERS:
        value = row.get("timers", {}).get(name)
        return None if value is None else float(value)
    if name == "busy":
        return float(row.get("busy", 0.0))
    if name == "loop mJ":
        joules = (row.get("loop") or {}).get("joules")
        return None if joules is None else 1e3 * float(joules)
    if name.startswith("loop "):
        loop = row.get("loop")
        return None if not loop else float(loop[name.removeprefix("loop ")])
    return float(row.get("stages", {}).get(name, 0.0))


def _moe_bench_rows(data: dict) -> list[dict]:
    """moe_bench's JSON table as rows of this module: one per (model, T, implementation), with its
    ms per call and, where the loop ran, ms per layer in the loop, as ``timers`` in us."""
    rows: dict[tuple, dict] = {}
    meta = ("model", "T", "floor", "layers")

    def row(r: dict, impl: str) -> dict:
        key = (r["model"], int(r["T"]), impl)
        return rows.setdefault(key, {"model": r["model"], "T": int(r["T"]), "impl": impl, "timers": {}})

    for r in data.get("rows", []):
        for impl, ms in r.items():
            if impl not in meta and isinstance(ms, (int, float)):
                row(r, impl)["timers"]["per call"] = 1e3 * ms
    for r in data.get("in_loop", []):
        for impl, pair in r.items():
            if impl not in meta and isinstance(pair, list) and len(pair) == 2 and pair[1] is not None:
                row(r, impl)["timers"]["in loop"] = 1e3 * pair[1]
    return list(rows.values())


def round_files(folder: str) -> list[tuple[str, int, str]]:
    """(side, round, path) of each round file ``<side>_<round>.json`` in ``folder``."""
    out = []
    for path in glob.glob(os.path.join(folder, "*_*.json")):
        m = re.fullmatch(r"(base|new)_(\d+)\.json", os.path.basename(path))
        if m:
            out.append((m.group(1), int(m.group(2)), path))
    return out


def read_rounds(folder: str) -> dict[str, dict[int, list[dict]]]:
    """``{side: {round: rows}}`` from ``<side>_<round>.json`` in ``folder`` (stage_breakdown's rows,
    or moe_bench's table read as rows)."""
    out: dict[str, dict[int, list[dict]]] = {side: {} for side in SIDES}
    for side, rnd, path in round_files(folder):
        with open(path) as f:
            data = json.load(f)
        out[side][rnd] = _moe_bench_rows(data) if isinstance(data, dict) else data
    return out


def table(rounds: dict[str, dict[int, list[dict]]], sides: str = "the base, then the new tree") -> list[str]:
    """Markdown lines: per (model, T, impl) and quantity, the base and new medians over rounds (us;
    "loop mJ" in millijoules),
    new / base of the medians, and the range of the rounds' own new / base. Rounds present on one side
    only, rows missing from a round, and loop figures missing from one side of a round, are left out.
    ``sides`` says in the last line what each round ran."""
    paired = sorted(set(rounds["base"]) & set(rounds["new"]))
    if not paired:
        raise ValueError("no round has both a base and a new file")
    key = lambda r: (r["model"], int(r["T"]), r["impl"])  # noqa: E731
    by_round = {side: {n: {key(r): r for r in rounds[side][n]} for n in paired} for side in SIDES}
    keys: list[tuple] = []
    for n in paired:
        for k in by_round["base"][n]:
            if k not in keys and all(k in by_round[s][n] for s in SIDES):
                keys.append(k)
    lines = ["| model | T | impl | quantity | base us | new us | new / base | rounds' range |",
             "|---|---|---|---|---|---|---|---|"]
    for k in keys:
        present = [n for n in paired if all(k in by_round[s][n] for s in SIDES)]
        for q in QUANTITIES:
            pairs = [tuple(_quantity(by_round[s][n][k], q) for s in SIDES) for n in present]
            pairs = [p for p in pairs if None not in p]  # the rounds with the figure on both sides
            vals = {s: [p[i] for p in pairs] for i, s in enumerate(SIDES)}
            if not any(vals["base"]) and not any(vals["new"]):
                continue
            base, new = statistics.median(vals["base"]), statistics.median(vals["new"])
            per = [b and nv / b for b, nv in zip(vals["base"], vals["new"])]
            ratio = f"{new / base:.3f}" if base else "n/a"
            spread = f"{min(per):.3f} - {max(per):.3f}" if base and all(per) else "n/a"
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {q} | {base:.1f} | {new:.1f} | {ratio} | {spread} |")
    lines.append(f"\n{len(paired)} round(s); each round ran {sides}, on one GPU.")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="write a git revision's tree to .base/ (carry it to the device)")
    pp.add_argument("rev")
    pp.add_argument("--dest", default=BASE_DIR)
    pt = sub.add_parser("table", help="the table of a side_by_side.sh run's rounds")
    pt.add_argument("folder")
    args = p.parse_args(argv)
    if args.command == "prepare":
        commit = prepare(args.rev, args.dest)
        print(f"{args.dest}/ holds {commit}: carry it with .fi, then run bench/side_by_side.sh on the device")
        return 0
    try:
        print("\n".join(table(read_rounds(args.folder))))
    except ValueError as err:
        print(f"side_by_side: {err} in {args.folder}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
