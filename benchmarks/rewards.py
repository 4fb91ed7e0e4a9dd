"""Rewards from models, side by side (docs/rewards.md), each measured against its baseline in
the same run:

- reward-model scoring, tokens/s: our ``reward_model`` (length-sorted, token-budgeted
  micro-batches) vs a plain transformers loop over the same batches
  (``reward_cases/reward_model.py``);
- LLM-judge throughput, responses/s: our judge served by the engine (continuous batching,
  the rubric prefilled once) vs transformers ``generate`` per response and per batch
  (``reward_cases/judge.py``);
- step time of on-policy distillation (advantage and loss modes) vs GRPO on the default job
  (``reward_cases/distill.py``).

    python benchmarks/rewards.py [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "reward_cases"))
sys.path.insert(0, str(HERE.parent))

from _common import parse_args, report  # noqa: E402


def main() -> None:
    args = parse_args(__doc__)
    import distill
    import judge
    import reward_model

    rows = []
    for case in (reward_model, judge, distill):
        print(f"# {case.__name__} ...", file=sys.stderr, flush=True)
        rows += case.rows(args.quick)
    report(rows, args.json)


if __name__ == "__main__":
    main()
