#!/usr/bin/env python
"""Write (and with --submit, submit) megaflow's Ray-on-Slurm sbatch script.

Same as ``python -m megaflow.launch.slurm``; see tools/slurm/README.md::

    python tools/slurm/submit.py --recipe llama70b_ppo --job-dir /shared/runs/70b \
        --partition gpu --account proj --time 2-00:00:00 --submit
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megaflow.launch.slurm import main

if __name__ == "__main__":
    sys.exit(main())
