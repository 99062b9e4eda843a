"""``python -m bench.published [PATH]``: write the cost model against the published rows (default
docs/results/model-vs-published.md), stamped with the date and commit; tests/plans/test_published.py checks that
the page's table is what the model gives now."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

from . import GOAL_SHARE, SPEEDUP_BAND, TIME_BAND, evaluate_all, render

DEFAULT = Path(__file__).resolve().parents[2] / "docs" / "results" / "model-vs-published.md"


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else DEFAULT
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    stamp = f"{datetime.date.today().isoformat()}, commit {commit}, computed on CPU (no GPU ran: the model only)"
    path.write_text(render(evaluate_all(), stamp))
    print(f"wrote {path} (goal: speedup within {SPEEDUP_BAND:.0%}, times within {TIME_BAND:.0%}, for "
          f"{GOAL_SHARE:.0%} of the rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
