import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import shared  # noqa: E402,F401  (sets OMP_WAIT_POLICY before any test loads torch)
