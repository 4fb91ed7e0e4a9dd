"""``python -m hybridrl ...`` (also what ``torchrun -m hybridrl`` runs)."""

import sys

from hybridrl.cli import main

sys.exit(main())
