import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The suite runs many processes on few cores at once: OpenMP threads there should sleep
# rather than spin (see shared/openmp.py). Services the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton kernels run on CPU tensors under its interpreter (tests/test_triton_attention.py); it
# must be set before any test module imports triton, or the kernels are built for a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
