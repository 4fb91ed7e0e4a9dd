"""``python -m hybridrl ...`` (also what ``torchrun -m hybridrl`` runs)."""

import sys

from hybridrl.cli import main

if __name__ == "__main__":  # a spawned child (rollout workers, reward pool) re-imports this module
    sys.exit(main())
