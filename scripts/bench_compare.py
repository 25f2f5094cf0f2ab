#!/usr/bin/env python3
"""Compare two epmem benchmark result files (scripts/bench.sh output).

  bench_compare.py BASE.json NEW.json [--noise NOISE.json] [--threshold F]
  bench_compare.py --measure-noise RUN1.json RUN2.json [-o NOISE.json]

For every scenario present in both files it prints NEW/BASE and whether the
change is a regression: worse (by the scenario's own direction) by more than
the noise threshold. The threshold is not a guess: --measure-noise takes two
runs of the same build and records, per scenario, the relative spread
|run2/run1 - 1|; a comparison then flags a scenario only when it moved more
than max(2 x its measured spread, the floor) where the floor is the median
spread over all scenarios. Exit status 1 when anything regressed.
"""
import argparse
import json
import statistics
import sys


def scenarios(path):
    with open(path) as f:
        run = json.load(f)
    out = {}
    for bench in run.get("benches", [run] if "scenarios" in run else []):
        for s in bench["scenarios"]:
            if s.get("value") is None:
                continue
            out[f'{bench["bench"]}/{s["name"]}'] = s
    return out


def measure_noise(a, b):
    sa, sb = scenarios(a), scenarios(b)
    spread = {}
    for k in sorted(sa.keys() & sb.keys()):
        va, vb = sa[k]["value"], sb[k]["value"]
        if va:
            spread[k] = abs(vb / va - 1.0)
    floor = statistics.median(spread.values()) if spread else 0.05
    return {"pairs": [a, b], "floor": floor, "spread": spread}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs=2)
    p.add_argument("--measure-noise", action="store_true")
    p.add_argument("-o", "--out")
    p.add_argument("--noise")
    p.add_argument("--threshold", type=float, help="fixed relative threshold instead of measured noise")
    a = p.parse_args()

    if a.measure_noise:
        n = measure_noise(*a.files)
        text = json.dumps(n, indent=1, sort_keys=True)
        if a.out:
            open(a.out, "w").write(text + "\n")
        print(f"noise over {len(n['spread'])} scenarios: median spread {n['floor']*100:.2f}%, "
              f"max {max(n['spread'].values(), default=0)*100:.2f}%")
        for k, v in sorted(n["spread"].items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {v*100:6.2f}%  {k}")
        return 0

    noise = json.load(open(a.noise)) if a.noise else None
    base, new = scenarios(a.files[0]), scenarios(a.files[1])
    regressions = 0
    print(f"{'scenario':60} {'base':>10} {'new':>10} {'ratio':>7} {'limit':>7}  verdict")
    for k in sorted(base.keys() & new.keys()):
        b, n = base[k]["value"], new[k]["value"]
        if not b:
            continue
        ratio = n / b
        if a.threshold is not None:
            limit = a.threshold
        elif noise:
            limit = max(2 * noise["spread"].get(k, noise["floor"]), noise["floor"])
        else:
            limit = 0.10
        worse = (1 - ratio) if base[k].get("higher_is_better", True) else (ratio - 1)
        verdict = "REGRESSION" if worse > limit else ("better" if worse < -limit else "same")
        regressions += verdict == "REGRESSION"
        print(f"{k[:60]:60} {b:10.4g} {n:10.4g} {ratio:7.3f} {limit*100:6.1f}%  {verdict}")
    only = sorted(base.keys() ^ new.keys())
    if only:
        print(f"{len(only)} scenarios in only one file: {', '.join(only[:8])}{' ...' if len(only) > 8 else ''}")
    print(f"{regressions} regression(s)")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
