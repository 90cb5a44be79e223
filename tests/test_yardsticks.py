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


def test_paired_times_each_run_beside_its_yardstick_order_alternating(monkeypatch):
    """checks/bench.py --paired: per engine run, R pairs, the engine first in odd pairs and the yardstick
    first in even ones, the yardstick over the same documents at the engine's own batch; a row per run
    whose median lies within its lowest and highest ratio."""
    import argparse

    from checks import bench
    from rmm.engine import StreamingEngine
    from rmm.policies import make_policy

    model = tiny_model("llama")
    docs = list(torch.randint(model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1)))
    engines = {
        f"{name}@b{batch}": StreamingEngine(
            model, make_policy({"name": name}, budget=8, chunk=4), batch=batch
        )
        for name, batch in (("window", 2), ("h2o", 3))
    }
    calls: list[tuple[str, int]] = []
    streamed = bench.stream_docs
    monkeypatch.setattr(
        bench, "stream_docs", lambda e, d: calls.append(("engine", e.options.batch)) or streamed(e, d)
    )
    monkeypatch.setattr(
        bench, "equal_work", lambda m, x, b, c: calls.append(("work", x.shape[0])) or equal_work(m, x, b, c)
    )
    args = argparse.Namespace(repeats=3, budget=8, chunk=4)
    rows = bench.paired(model, docs, engines, args)
    # window at batch 2: groups of 2 and 1 documents; h2o at batch 3: one group of 3
    window = [("engine", 2), ("work", 2), ("work", 1)]
    expect = [
        *window, ("work", 2), ("work", 1), ("engine", 2), *window,
        ("engine", 3), ("work", 3), ("work", 3), ("engine", 3), ("engine", 3), ("work", 3),
    ]  # fmt: skip
    assert calls == expect
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        median, lowest, highest = (float(c) for c in cells[4:7])
        assert 0 < lowest <= median <= highest
