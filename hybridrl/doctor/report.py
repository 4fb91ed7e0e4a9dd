"""The doctor's outputs: a terminal table, ``mismatch.json`` and ``mismatch.png`` (gap by
cause; |dlogp| vs token entropy), written together into a new folder (atomically: a
failure leaves no partial folder)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hybridrl.doctor.mismatch import Diagnosis


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def format_table(d: Diagnosis) -> str:
    t = d.total
    lines = [f"rollout/trainer gap over {t['tokens']} response tokens: token KL {t['kl']:.3g}, max |dlogp| "
             f"{t['max_abs']:.3g}, {t['frac_over_1e-3']:.1%} of tokens over 1e-3", "",
             f"{'cause':<22} {'job setting':<40} {'KL effect':>10} {'share':>7}  note"]
    for c in d.causes:
        share = (f"{c.effect_kl / t['kl']:.0%}" if c.additive and c.effect_kl is not None and t["kl"] else "")
        lines.append(f"{c.name:<22} {c.setting[:40]:<40} {_num(c.effect_kl):>10} {share:>7}  {c.note}")
    if t["kl"] and not any(c.additive and c.effect_kl is not None for c in d.causes):
        lines.append(f"{'sum of the causes':<22} {'':<40} {'n/a':>10}          (no cause could be switched off here)")
    elif t["kl"]:
        lines.append(f"{'sum of the causes':<22} {'':<40} {d.explained_kl:>10.3g} {d.explained_kl / t['kl']:>7.0%}  "
                     "(each measured alone; the total is 100%)")
    lines += ["", "by response position:"]
    lines += [f"  [{b['from']}, {b['to'] if b['to'] < 10**8 else 'end'}): KL {b['kl']:.3g}, max {b['max_abs']:.3g}, "
              f"{b['tokens']} tokens" for b in d.by_position]
    lines += ["by token entropy (trainer):"]
    lines += [f"  [{b['from']}, {b['to']}): KL {b['kl']:.3g}, max {b['max_abs']:.3g}, {b['tokens']} tokens"
              for b in d.by_entropy]
    lines += ["", "recommended for this job (measured on this batch):"] + [f"  - {r}" for r in d.recommendations]
    return "\n".join(lines)


def plot(d: Diagnosis, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    shown = [c for c in d.causes if c.effect_kl is not None]
    a.barh([c.name for c in shown][::-1], [max(c.effect_kl, 0.0) for c in shown][::-1],
           color=["tab:blue" if c.additive else "tab:gray" for c in shown][::-1])
    a.axvline(d.total["kl"], color="k", ls="--", lw=1, label=f"total {d.total['kl']:.2g}")
    a.set_xlabel("token KL explained (k3)")
    a.set_title("gap by cause (gray: not in the sum)")
    a.legend(loc="lower right")
    ent, diff = d.scatter.get("entropy", []), d.scatter.get("abs_diff", [])
    b.scatter(ent, [max(x, 1e-12) for x in diff], s=4, alpha=0.5)
    b.set_yscale("log")
    b.set_xlabel("token entropy (trainer, nats)")
    b.set_ylabel("|logp trainer - logp rollout|")
    b.set_title("per-token gap vs entropy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(d: Diagnosis, out: Path) -> Path:
    """``out/`` with mismatch.json, mismatch.png, mismatch.txt; ``out`` must not exist."""
    out = Path(out)
    if out.exists():
        raise ValueError(f"doctor mismatch: {out} already exists; choose a new --out")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        (tmp / "mismatch.json").write_text(json.dumps(d.to_json(), indent=1))
        (tmp / "mismatch.txt").write_text(format_table(d) + "\n")
        plot(d, tmp / "mismatch.png")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
