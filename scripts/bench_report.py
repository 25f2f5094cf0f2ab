#!/usr/bin/env python3
"""Turn a merged results file from scripts/bench.sh into docs.

  bench_report.py RESULTS.json --md OUT.md [--img-dir DIR] [--img-prefix docs/img/]

The markdown starts with the date, GPU, driver, command and run counts, then,
per benchmark, the table the benchmark printed itself (its targets included)
and a table of every scenario's median. For every (bench, group) whose
scenarios carry an x value it draws a PNG: one line per series (the part of the
scenario name before '/'), so page-in GB/s against copy size, decode step time
against budget fraction and admissible concurrency against sharers all come
out of the same code. A series named like 'peak' or 'e_peak' is drawn dashed.
"""
import argparse
import collections
import json
import os


def plots(run, img_dir, prefix):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    made = collections.defaultdict(list)
    for bench in run["benches"]:
        groups = collections.defaultdict(list)
        for s in bench["scenarios"]:
            if s.get("x") is not None and s.get("value") is not None:
                groups[s["group"]].append(s)
        for group, ss in groups.items():
            series = collections.defaultdict(list)
            for s in ss:
                series[s["name"].split("/")[0]].append((s["x"], s["value"], s["unit"]))
            if not any(len(v) > 1 for v in series.values()):
                continue
            fig, ax = plt.subplots(figsize=(7, 4.2))
            unit = ss[0]["unit"]
            for name, pts in sorted(series.items()):
                pts.sort()
                style = "--" if "peak" in name else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
            if group in ("pagein", "size"):
                ax.set_xscale("log", base=2)
            ax.set_xlabel(bench.get("x_labels", {}).get(group, group))
            ax.set_ylabel(unit)
            ax.set_title(f'{bench["bench"]}: {group} ({run.get("gpu", "")})')
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fname = f'{bench["bench"]}_{group}.png'
            fig.tight_layout()
            fig.savefig(os.path.join(img_dir, fname), dpi=110)
            plt.close(fig)
            made[bench["bench"]].append(prefix + fname)
    return made


def main():
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--md", required=True)
    p.add_argument("--img-dir", default=None)
    p.add_argument("--img-prefix", default="img/")
    a = p.parse_args()
    run = json.load(open(a.results))
    made = {}
    if a.img_dir:
        os.makedirs(a.img_dir, exist_ok=True)
        made = plots(run, a.img_dir, a.img_prefix)
    out = []
    out.append(f'Date: {run.get("date")} · GPU: {run.get("gpu")} · driver: {run.get("driver")} · '
               f'device kind: {run.get("kind", "cuda")}')
    out.append("")
    out.append(f'Command: `{run.get("command")}`')
    out.append("")
    for bench in run["benches"]:
        out.append(f'### {bench["bench"]}')
        out.append("")
        out.append(f'Each figure is the median of {bench["runs"]} runs after {bench["warmup"]} warm-up runs.')
        out.append("")
        if bench.get("markdown"):
            out.append(bench["markdown"].rstrip())
            out.append("")
        for img in made.get(bench["bench"], []):
            out.append(f"![{os.path.basename(img)}]({img})")
            out.append("")
        out.append("<details><summary>all scenarios</summary>")
        out.append("")
        out.append("| scenario | median | unit | n |")
        out.append("|---|---:|---|---:|")
        for s in bench["scenarios"]:
            v = s.get("value")
            out.append(f'| {s["group"]}/{s["name"]} | {v:.4g} | {s["unit"]} | {len(s.get("samples", []))} |'
                       if v is not None else f'| {s["group"]}/{s["name"]} | – | {s["unit"]} | 0 |')
        out.append("")
        out.append("</details>")
        out.append("")
    open(a.md, "w").write("\n".join(out) + "\n")
    print(f"wrote {a.md} and {sum(len(v) for v in made.values())} plots")


if __name__ == "__main__":
    main()
