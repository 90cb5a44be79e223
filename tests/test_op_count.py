"""checks/op_count.py on a 2-layer model: ops land in their phases, counts repeat, host syncs are seen."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

from checks import op_count
from rmm.policies.h2o import H2O
from rmm.transfer import to_device

BUDGET, CHUNK, BATCH = 32, 8, 2


@functools.cache
def model():
    return op_count.op_model(layers=2)


@functools.cache
def counted(policy: str | None) -> op_count.PerPass:
    return op_count.count(model(), policy, BATCH, BUDGET, CHUNK)


def test_ops_land_in_their_phases() -> None:
    plain, h2o, window = counted(None), counted("h2o"), counted("window")
    assert plain.total_ops > 0 and plain.ops["model"] == plain.total_ops
    assert 0 < plain.kernels < plain.total_ops  # views launch no kernel
    assert all(h2o.ops[phase] > 0 for phase in op_count.PHASE_NAMES), h2o.ops
    assert window.ops["attention"] > 0 and window.ops["masks"] > 0 and window.ops["compaction"] > 0
    assert window.ops["scoring"] == 0 and window.ops["decision"] > 0, window.ops  # the rule's keep mask
    # per pass: a whole number of ops, the same for every pass between the two stream lengths
    assert all(n == int(n) for row in (plain, h2o, window) for n in row.ops.values())


def test_counts_are_deterministic() -> None:
    again = op_count.count(model(), "h2o", BATCH, BUDGET, CHUNK)
    assert again == counted("h2o")


def test_an_injected_item_is_a_host_sync() -> None:
    score = H2O.score

    def score_and_read(self, state, obs, now):
        state["acc"].sum().item()  # one host sync per decision
        return score(self, state, obs, now)

    with mock.patch.object(H2O, "score", score_and_read):
        injected = op_count.count(model(), "h2o", BATCH, BUDGET, CHUNK)
    base = counted("h2o")
    assert injected.syncs["scoring"] == base.syncs["scoring"] + BATCH  # one decision per stream and pass
    assert injected.total_syncs == base.total_syncs + BATCH
    assert any(
        op == "aten._local_scalar_dense" and "score_and_read" in where for _, op, where in injected.sites
    )


def test_host_sync_list() -> None:
    counter = op_count.OpCounter()
    x = torch.arange(6.0)
    with counter, op_count._HostReads(counter):
        y = x * 2 + 1  # no sync
        x.masked_fill(x > 2, 0.0)  # no sync
        x[x > 2]  # boolean indexing
        torch.nonzero(x)
        x.tolist()
        bool(x[0])
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]))  # output size from values
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]), output_size=7)  # no sync
        y[torch.tensor([0, 1])]  # integer indexing: no sync
        torch.tensor([1, 2], device="cpu")  # host data to a named device: a blocking copy on a GPU
        torch.as_tensor(x, device="cpu")  # a tensor already: no copy from the host
        to_device([1, 2], x.device)  # staged in pinned memory on a GPU: no sync
    assert counter.syncs["model"] == 6, counter.sites
    assert counter.ops["model"] > counter.syncs["model"]


def test_a_missing_phase_target_names_the_table() -> None:
    with (
        mock.patch.dict(op_count.PHASES, {(op_count.engine, "no_such_step"): "decision"}),
        pytest.raises(RuntimeError, match="PHASES"),
    ):
        op_count.count(model(), "window", BATCH, BUDGET, CHUNK)


@pytest.mark.parametrize("policy", ["h2o", "window"])
def test_a_pass_makes_no_host_sync(policy: str) -> None:
    """A pass waits for the device nowhere: not in the engine, its memory, masks or policies, host data
    handed to the device (tokens, chunk starts, boundaries) included, and not in the model's forward
    (transformers' check for packed sequences, skipped because the pass hands it an empty cache)."""
    assert not counted(policy).sites
