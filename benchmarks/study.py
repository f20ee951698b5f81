"""The study of what ExGRPO buys over GRPO at CPU scale (`python -m lab.study`), with its committed results.

    python benchmarks/study.py                                  # the main arms on every task, 5 seeds
    python benchmarks/study.py --tasks addition --seeds 0-2 \
        --arms uniform_questions,random_trajectory,no_shaping,keep_retired,revisit_no_replay,grpo_skip_retired

Every finished run is saved as benchmarks/results/study/<task>/<arm>/seed<k>.json and skipped when found, so the
study resumes where it stopped. See `lab/study/run.py` for what a run records.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.study import main

if __name__ == "__main__":
    sys.exit(main())
