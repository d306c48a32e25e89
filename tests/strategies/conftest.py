import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models on a shared 2-core machine: OpenMP threads waiting on each other under load cost
    ~100x (0.3 s vs 2 ms per forward measured here); one thread is what these tests need."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
