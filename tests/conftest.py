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

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_hf(tmp_path_factory):
    """transformers' float32 model of the default GGUF, loaded once for the whole session."""
    from tests.hf_reference import load_default_hf
    return load_default_hf(str(tmp_path_factory.mktemp("default-gguf")))


@pytest.fixture(scope="session")
def smollm_chat(default_hf):
    """(prompts, [(greedy tokens, logits)]) of the default model on tests/hf_reference.py's
    chat prompts."""
    from tests.hf_reference import default_chat_references
    return default_chat_references(default_hf)
