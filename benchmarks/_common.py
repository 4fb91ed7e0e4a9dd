"""Shared pieces of the benchmark scripts: ``--quick`` / ``--json PATH`` arguments,
timing, the JSON row format and the side-by-side table.

A row is one measured quantity, ours next to a baseline measured in the same run (never
a stored number)::

    {"case": "32x8", "metric": "step s", "ours": 1.2, "baseline": 3.4,
     "baseline_name": "trl GRPOTrainer", "higher_is_better": false}

The printed ``speedup`` is how many times better ours is: ``baseline / ours`` when lower
is better, ``ours / baseline`` when higher is better (> 1 means ours wins either way).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from contextlib import contextmanager
from typing import Iterator

ROW_KEYS = ("case", "metric", "ours", "baseline", "baseline_name", "higher_is_better")


def parse_args(doc: str | None = None, extra=None) -> argparse.Namespace:
    """``--quick`` and ``--json PATH``; ``extra(parser)`` may add script-specific options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, under a minute on 2 CPU cores")
    ap.add_argument("--json", metavar="PATH", help='write {"rows": [...]} to PATH')
    if extra is not None:
        extra(ap)
    return ap.parse_args()


@contextmanager
def timed(into: list[float]) -> Iterator[None]:
    """Append the wall-clock seconds of the ``with`` body to ``into``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into.append(time.perf_counter() - t0)


def best_interleaved(fns: list, repeats: int) -> list[float]:
    """Best wall time of each callable over ``repeats`` rounds, after one warm-up call each.

    The callables run interleaved within every round, so the load drifts of a shared
    machine hit ours and the baselines alike; the minimum is the least noisy estimate.
    """
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def median(xs: list[float]) -> float:
    if not xs:
        raise ValueError("median of no measurements: run more steps than the warm-up ones")
    return float(statistics.median(xs))


def row(*, case: str, metric: str, ours: float, baseline: float, baseline_name: str,
        higher_is_better: bool) -> dict:
    """One JSON row (the keys in :data:`ROW_KEYS`)."""
    return dict(case=case, metric=metric, ours=float(ours), baseline=float(baseline), baseline_name=baseline_name,
                higher_is_better=bool(higher_is_better))


def speedup(r: dict) -> float:
    """> 1 means ours is better, whichever direction the metric points."""
    num, den = (r["ours"], r["baseline"]) if r["higher_is_better"] else (r["baseline"], r["ours"])
    return num / den if den else float("inf")


def format_table(rows: list[dict]) -> str:
    w_case = max([len("case")] + [len(r["case"]) for r in rows]) + 2
    w_metric = max([len("metric")] + [len(r["metric"]) for r in rows]) + 2
    lines = [f"{'case':<{w_case}}{'metric':<{w_metric}}{'ours':>10}{'baseline':>10}{'speedup':>9}  baseline"]
    for r in rows:
        ratio = speedup(r)
        ratio_text = f"{ratio:>8.2f}x" if math.isfinite(ratio) else f"{'(0)':>9}"  # ours is 0, lower is better
        lines.append(f"{r['case']:<{w_case}}{r['metric']:<{w_metric}}{r['ours']:>10.4g}{r['baseline']:>10.4g}"
                     f"{ratio_text}  {r['baseline_name']}")
    return "\n".join(lines)


def write_json(path: str, rows: list[dict]) -> None:
    for r in rows:
        missing = set(ROW_KEYS) - set(r)
        assert not missing, f"benchmark row {r} lacks {sorted(missing)}"
    with open(path, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


def report(rows: list[dict], json_path: str | None) -> None:
    """Print the table and, when asked, write the JSON file."""
    print(format_table(rows))
    if json_path:
        write_json(json_path, rows)
        print(f"wrote {json_path}")
