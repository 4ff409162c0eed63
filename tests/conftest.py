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
def smollm_chat(request, tmp_path_factory):
    """(prompts, [(greedy tokens, logits)]) of the default model on tests/hf_reference.py's
    chat prompts: computed once per test run (~15 s), by the first worker process to need it."""
    from tests.hf_reference import default_chat_references
    return once_per_run(request, tmp_path_factory, "smollm-chat-references",
                        lambda: default_chat_references(request.getfixturevalue("default_hf")))


def once_per_run(request, tmp_path_factory, name: str, compute):
    """`compute()`, shared by this run's pytest-xdist worker processes through a file in the
    run's own temporary folder (gone with the run): the first to get here computes it, the
    others wait for it and read it. Without xdist: computed here."""
    import torch
    from filelock import FileLock
    if not hasattr(request.config, "workerinput"):      # not an xdist worker
        return compute()
    path = tmp_path_factory.getbasetemp().parent / f"{name}.pt"     # the workers' common root
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return torch.load(path, weights_only=True)
        value = compute()
        torch.save(value, path)
        return value
