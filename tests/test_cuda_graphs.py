"""``cuda_graphs.capture``: a graph that replays what it captured, taken without emptying the
caching allocator (which ``torch.cuda.graph`` does before every capture)."""

from __future__ import annotations

import pytest
import torch

from fp4select import cuda_graphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_graph_replays_its_work_and_the_cached_blocks_stay():
    device = torch.device("cuda")
    cached = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    del cached  # 64 MiB back in the caching allocator, not the driver
    reserved = torch.cuda.memory_reserved(device)
    x = torch.arange(1024, dtype=torch.float32, device=device)
    y = torch.zeros_like(x)

    graph = cuda_graphs.capture(lambda: y.copy_(x * 2), device)
    assert torch.cuda.memory_reserved(device) >= reserved  # torch.cuda.graph would free them
    y.zero_()
    x += 1
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(y, x * 2)


def test_an_error_inside_the_capture_reaches_the_caller_and_ends_the_capture():
    device = torch.device("cuda")
    x = torch.ones(8, device=device)

    def fails() -> None:
        x.mul_(2)
        raise ValueError("a runner's own error")

    with pytest.raises(ValueError, match="a runner's own error"):
        cuda_graphs.capture(fails, device)
    assert not torch.cuda.is_current_stream_capturing()
    x.add_(1)  # eager work runs again on this stream
    torch.cuda.synchronize(device)
    assert torch.equal(x, torch.full_like(x, 2.0))  # the captured mul_ never ran
