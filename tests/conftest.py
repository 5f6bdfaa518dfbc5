import contextlib

import pytest
import torch

# most multi-rank tests build Hugging Face models: imported here, transformers is imported once by the fork server
# every test's ranks start from (`autopar.cluster.ranks.prestart`), not by each rank
with contextlib.suppress(ImportError):
    import transformers.modeling_utils  # noqa: F401


@pytest.fixture(autouse=True)
def _single_thread():
    torch.set_num_threads(1)
    yield
