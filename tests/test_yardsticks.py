"""checks/yardsticks.py's equal-work yardstick: it runs, and its KV cache never exceeds the budget."""

from __future__ import annotations

import pytest
import torch

from checks.matrix import tiny_model
from checks.yardsticks import equal_work
from rmm.integration import cache_keyword


@pytest.mark.parametrize(
    ("n", "budget", "chunk", "most"), [(41, 12, 4, 12), (30, 12, 1, 12), (25, 8, 8, 8), (5, 12, 4, 4)]
)
def test_equal_work_attends_at_most_the_budget(n: int, budget: int, chunk: int, most: int):
    """Every pass, seen from the model's own forward: C new tokens per stream for all N streams, and a
    cache of at most B - C + 1 keys, so that the pass's last query attends at most B besides its own
    (exactly B once the stream fills the cache; 4 on the 5-token stream)."""
    model = tiny_model("llama")
    keyword = cache_keyword(model)
    passes: list[tuple[int, int, int]] = []  # (streams, new tokens, most cached keys of a layer) per pass

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cached = max((layer.get_seq_length() for layer in kwargs[keyword].layers), default=0)
        passes.append((*args[0].shape, cached))

    tokens = torch.randint(model.config.vocab_size, (3, n), generator=torch.Generator().manual_seed(0))
    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        seen = equal_work(model, tokens, budget, chunk)
    finally:
        handle.remove()
    assert [new for _, new, _ in passes] == [min(chunk, n - start) for start in range(0, n, chunk)]
    assert {streams for streams, _, _ in passes} == {3}
    assert all(cached <= budget - chunk + 1 for _, _, cached in passes), passes
    assert seen == max(cached + new - 1 for _, new, cached in passes) == most


def test_equal_work_refuses_a_chunk_above_the_budget():
    with pytest.raises(ValueError, match="chunk <= budget"):
        equal_work(tiny_model("llama"), torch.zeros(1, 8, dtype=torch.long), budget=4, chunk=5)
