"""Run every benchmark once and write one markdown table of that run.

    python benchmarks/report.py [--full] [--only masks,packing] [--out bench_out]
                                [--max-wait S] [--per-core L] [--timeout S]

Runs ``benchmarks/[a-z]*.py`` (all but this script; ``--only``: the named ones), one
after the other, each as ``python NAME.py --quick --json OUT/NAME.json`` (``--full``: without
``--quick``), its output shown and kept in ``OUT/NAME.log``. Before each script it waits
up to ``--max-wait`` seconds for the 1-minute load average to drop below ``--per-core`` x
cores (``_machine.wait_for_quiet``), and the script's JSON records the load it started
under and the load at its end.

Then ``OUT/README_table.md`` is written from this run's JSON files only (each is deleted
before its script runs, so nothing from another run can enter): headed by the machine
stamp (measured now) and the date, one line per row: benchmark, case, metric, ours,
baseline, what the baseline ran with, the ratio oriented so that > 1 means ours is better
(``baseline / ours`` when lower is better, ``ours / baseline`` when higher is better) and
the load (before -> after). A script that fails (non-zero exit, no JSON, or an ``"error"``
in its JSON) gets a FAILED line with its one-line error, after any rows it wrote, and the
run goes on; the exit status is 1 when any failed. When ``step.py``'s JSON has the phase
rows, ``OUT/step_breakdown.png`` shows ours and the baseline's step time by phase.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _machine  # noqa: E402
from _common import speedup  # noqa: E402

TABLE = "README_table.md"
PNG = "step_breakdown.png"
STEP_PHASES = ("rollout", "reward", "update")  # step.py's phase rows: "<phase> s", plus "step s"
COLUMNS = ("benchmark", "case", "metric", "ours", "baseline", "baseline (what it ran with)",
           "ratio (>1: ours better)", "load (before → after)")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Timeout)|AssertionError)\b.*")


def scripts() -> list[str]:
    return sorted(p.stem for p in HERE.glob("[a-z]*.py") if p.stem != "report")


# ---- running ------------------------------------------------------------------------------
def error_line(output: str, rc: int) -> str:
    """The one line that says why a script failed: its exception line (the last one of the
    output), else its last non-empty line, prefixed by the exit status."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    found = next((ln for ln in reversed(lines) if _EXCEPTION_LINE.match(ln)), None)
    text = found or (lines[-1] if lines else "no output")
    return f"exit {rc}: {text[:240]}"


def run_script(name: str, out: Path, *, quick: bool, timeout_s: float | None, max_wait_s: float,
               per_core: float) -> dict:
    """Run one benchmark; ``{"name", "rc", "seconds", "json" (dict or None), "error" (None when ok),
    "load" (report.py's own before/after)}``."""
    json_path, log_path = out / f"{name}.json", out / f"{name}.log"
    json_path.unlink(missing_ok=True)  # a file left by another run must not enter this table
    before = _machine.wait_for_quiet(max_wait_s, per_core, say=lambda s: print(f"[report] {s}", flush=True))
    cmd = [sys.executable, str(HERE / f"{name}.py"), *(["--quick"] if quick else []), "--json", str(json_path)]
    print(f"[report] {' '.join(cmd[1:])}  (load {before:.2f})", flush=True)
    t0 = time.monotonic()
    lines: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)

        def pump() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
                lines.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the script's own process group (it may have spawned ranks)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
        reader.join(timeout=30)
    seconds = time.monotonic() - t0
    result = {"name": name, "rc": rc, "seconds": seconds, "json": None, "error": None,
              "load": {"before": before, "after": _machine.load_average()}}
    if json_path.exists():
        try:
            result["json"] = json.loads(json_path.read_text())
        except (OSError, ValueError) as e:
            result["error"] = f"unreadable JSON {json_path.name}: {e}"
    if rc is None:
        result["error"] = f"timed out after {timeout_s:g} s"
    elif result["json"] is not None and result["json"].get("error"):
        result["error"] = f"exit {rc}: {result['json']['error']}"
    elif rc != 0:
        result["error"] = error_line("".join(lines), rc)
    elif result["json"] is None and result["error"] is None:
        result["error"] = f"exit 0 but no {json_path.name} written"
    return result


# ---- the table ------------------------------------------------------------------------------
def _cell(x) -> str:
    return str(x).replace("\n", " ").replace("|", "\\|")


def _num(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def _ratio(r: dict) -> str:
    ratio = speedup(r)
    if math.isnan(ratio):
        return "—"
    if math.isfinite(ratio):
        return f"{ratio:.2f}x"
    return "∞ (baseline 0)" if r["higher_is_better"] else "∞ (ours 0)"


def _load(load: dict | None) -> str:
    if not load:
        return "—"
    b, a = load.get("before"), load.get("after")
    return f"{_num(b)} → {_num(a)}"


def machine_line(m: dict) -> str:
    parts = [f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores", f"torch CPU capability {m.get('torch_cpu_capability')}",
             f"memcpy {_num(m.get('memcpy_gbps'))} GB/s", f"GPU {m.get('gpu') or 'none'}"]
    versions = ", ".join(f"{p} {m.get(p) or '—'}" for p in _machine.PACKAGES)
    return "; ".join(parts) + f"; {versions}; python {m.get('python', '?')}"


def build_table(results: list[dict], machine: dict, *, command: str = "", wait: str = "") -> str:
    """The markdown of one run: ``results`` as :func:`run_script` returns them (in run order),
    ``machine`` the stamp of this run (:func:`_machine.stamp`)."""
    stamps = [r["json"]["machine"] for r in results if r.get("json") and isinstance(r["json"].get("machine"), dict)]
    memcpy = [s["memcpy_gbps"] for s in stamps if isinstance(s.get("memcpy_gbps"), (int, float))]
    out = [f"# Benchmarks, {machine.get('date', '?')}", "",
           f"**Machine:** {machine_line(machine)}."]
    if memcpy:
        out[-1] += f" memcpy in the scripts' own stamps: {min(memcpy):.4g}–{max(memcpy):.4g} GB/s."
    failed = [r["name"] for r in results if r.get("error")]
    out += ["", f"**Run:** `{command or 'benchmarks/report.py'}`: {len(results)} script(s), "
                f"{len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}. Every number is from "
                f"this run. Ratio: > 1 means ours is better (baseline/ours where lower is better, ours/baseline "
                f"where higher is better). Load: the 1-minute load average when the script started and when it "
                f"wrote its results (it includes the script's own work){'; ' + wait if wait else ''}.", "",
            "| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for res in results:
        data = res.get("json") or {}
        load = _load(data.get("load") or res.get("load"))
        rows = data.get("rows") or []
        for r in rows:
            cells = [res["name"], r["case"], r["metric"], _num(r["ours"]), _num(r["baseline"]), r["baseline_name"],
                     _ratio(r), load]
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        if res.get("error"):
            cells = [res["name"], "**FAILED**", "—", "—", "—", res["error"], "—", load]
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        elif not rows:
            cells = [res["name"], "(no rows)", "—", "—", "—", "—", "—", load]
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


# ---- the step-time breakdown ---------------------------------------------------------------
def step_breakdown(rows: list[dict]) -> dict | None:
    """``{"case", "baseline_name", "ours": {phase: s}, "baseline": {...}}`` from step.py's rows
    (phases rollout / reward / update, ``other`` = step minus their sum), or None without them."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["metric"]] = r
    for case, metrics in by_case.items():
        needed = ["step s", *(f"{p} s" for p in STEP_PHASES)]
        if all(k in metrics for k in needed):
            out = {"case": case, "baseline_name": metrics["step s"]["baseline_name"]}
            for side in ("ours", "baseline"):
                phases = {p: float(metrics[f"{p} s"][side]) for p in STEP_PHASES}
                phases["other"] = max(0.0, float(metrics["step s"][side]) - sum(phases.values()))
                out[side] = phases
            return out
    return None


def plot_breakdown(b: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["ours (hybridrl)", b["baseline_name"]]
    fig, ax = plt.subplots(figsize=(9, 2.6))
    left = [0.0, 0.0]
    for phase in (*STEP_PHASES, "other"):
        widths = [b["ours"][phase], b["baseline"][phase]]
        ax.barh(labels, widths, left=left, label=phase)
        left = [x + w for x, w in zip(left, widths)]
    ax.set_xlabel("seconds per step (medians)")
    ax.set_title(f"step time by phase, {b['case']}")
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="run the scripts without --quick")
    ap.add_argument("--only", help="comma-separated script names (default: all of " + ", ".join(scripts()) + ")")
    ap.add_argument("--out", default="bench_out", help="folder for the JSON files, logs and the table")
    ap.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for a quiet machine before each")
    ap.add_argument("--per-core", type=float, default=0.5, help="quiet: 1-minute load average below this x cores")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per script before it is killed")
    args = ap.parse_args(argv)
    names = scripts()
    if args.only:
        wanted = [n.strip().removesuffix(".py") for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            ap.error(f"--only: no benchmark {', '.join(unknown)} (have {', '.join(names)})")
        names = [n for n in names if n in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / PNG).unlink(missing_ok=True)
    machine = _machine.stamp()
    print(f"[report] machine: {machine_line(machine)}", flush=True)
    results = [run_script(n, out, quick=not args.full, timeout_s=args.timeout, max_wait_s=args.max_wait,
                          per_core=args.per_core) for n in names]
    command = "python benchmarks/report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    wait = (f"before each script it waited up to {args.max_wait:g} s for the load to drop below "
            f"{_machine.threshold(args.per_core):g} ({args.per_core:g} per core)")
    table = build_table(results, machine, command=command.strip(), wait=wait)
    step = next((r for r in results if r["name"] == "step" and r.get("json")), None)
    breakdown = step_breakdown(step["json"].get("rows") or []) if step else None
    if breakdown is not None:
        try:
            plot_breakdown(breakdown, out / PNG)
            table += f"\n![step time by phase]({PNG})\n"
        except Exception as e:  # noqa: BLE001 - the table matters more than the picture
            print(f"[report] no {PNG}: {type(e).__name__}: {e}", flush=True)
    (out / TABLE).write_text(table)
    print("\n" + table + f"\n[report] wrote {out / TABLE}" + (f" and {out / PNG}" if breakdown else ""), flush=True)
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
