"""Progress bars (tqdm: rate and ETA) that can be switched off for tests and logs."""

from __future__ import annotations

import sys


def progress_bar(iterable, *, desc: str, enabled: bool = True, initial: int = 0, total: int | None = None):
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, disable=not enabled, initial=initial, total=total, dynamic_ncols=True, file=sys.stderr,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                           "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")
