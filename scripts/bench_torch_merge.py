#!/usr/bin/env python3
"""Merge bench_torch.py results from separate runs (a shape or two per GPU call
keeps each call under the device's time limit) into one JSON, table and plot.

    python3 scripts/bench_torch_merge.py big.json gqa.json small.json --json bench_torch.json [--plot P]

Each row keeps the floor of its own run (its own pinned H2D peak, kept as the
row's h2d_peak_bytes_per_s). A shape may appear in several runs (e.g. budgets
split across calls): its all-resident reference must then be the same tokens in
every run (the model is rebuilt from the same config and seed, so anything else
is a defect and the merge fails)."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_torch  # noqa: E402  (its table and plot; importing it imports torch and epmem)


def _tokens(sh):
    return {m: r.get("tokens") for m, r in sh["resident"].items()}


def merge(results):
    out = {k: v for k, v in results[0].items() if k not in ("shapes", "wall_s", "notes", "mismatches")}
    # an input that is itself a merge keeps its runs (and its rows their own peaks)
    out["runs"] = [run for r in results for run in r.get("runs") or
                   [{"h2d_peak_bytes_per_s": r["h2d_peak_bytes_per_s"], "wall_s": r.get("wall_s"),
                     "shapes": [s["name"] for s in r["shapes"]],
                     "budgets": sorted({row["budget_pct"] for s in r["shapes"] for row in s["rows"]
                                        if row["budget_pct"] is not None})}]]
    shapes = {}
    for r in results:
        for s in r["shapes"]:
            if s["name"] not in shapes:
                shapes[s["name"]] = dict(s, rows=[])
            elif _tokens(shapes[s["name"]]) != _tokens(s):
                raise SystemExit(f"bench_torch_merge: {s['name']}: the all-resident tokens differ between runs")
            for row in s["rows"]:
                peak = row.get("h2d_peak_bytes_per_s", r["h2d_peak_bytes_per_s"])
                shapes[s["name"]]["rows"].append(dict(row, h2d_peak_bytes_per_s=peak))
    out["shapes"] = list(shapes.values())
    out["notes"] = sorted({n for r in results for n in r.get("notes", [])})
    out["mismatches"] = [m for r in results for m in r.get("mismatches", [])]
    out["wall_s"] = sum(r.get("wall_s") or 0 for r in results)
    out["tokens_identical"] = all(r.get("tokens_identical") for r in results)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot")
    a = ap.parse_args()
    res = merge([json.load(open(p)) for p in a.inputs])
    bench_torch.write_results(res, a.json, a.plot)
    print("tokens identical in every row" if res["tokens_identical"] else "TOKENS DIFFER in some run")
    return 0 if res["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
