"""bf16 in the engine: a bf16 copy of each tiny model against the fp32 reference.

Stated tolerance (tests/test_bf16.py): per-token NLL within BF16_NLL_ATOL of the fp32 reference, and
the retained sets (per boundary, layer and KV head) identical in at least MIN_AGREEMENT of all cases.
``pytest tests/test_bf16.py -s`` prints the measured table.
"""

from __future__ import annotations

import itertools

import torch
from conftest import tiny_model
from test_policies import BUDGET, reference, retained_sets

BF16_NLL_ATOL = 0.1
MIN_AGREEMENT = 0.75
CASES = [("streaming_llm", {"sinks": 2}), ("h2o", {}), ("rmm", {"lag": 3}), ("tova", {}), ("oracle", {})]


def test_bf16_engine_against_fp32_reference(streams):
    rows, agreeing, total = [], 0, 0
    for arch, (name, params), positions in itertools.product(
        ["llama", "gpt_neox"], CASES, ["original", "cache"]
    ):
        model = tiny_model(arch).to(torch.bfloat16)
        tokens = streams[arch]
        ref_chunk = 1 if name == "streaming_llm" else 4
        ref_nll, _, ref_sets = reference(arch, name, tuple(sorted(params.items())), ref_chunk, positions)
        result, sets = retained_sets(model, tokens, name, params, chunk=4, positions=positions)
        diff = (result.nll - ref_nll).abs()
        pairs = [
            zip(la, lb, strict=True) for now in sets for la, lb in zip(sets[now], ref_sets[now], strict=True)
        ]
        same = [a == b for layer in pairs for a, b in layer]
        agreeing, total = agreeing + sum(same), total + len(same)
        share = sum(same) / len(same)
        rows.append(f"{arch:9s} {name:14s} {positions:9s} {diff.max():.4f} {diff.mean():.4f} {share:.3f}")
        assert diff.max() <= BF16_NLL_ATOL, rows[-1]
    print(
        f"\nbf16 engine vs fp32 reference, B={BUDGET}, C=4: arch, policy, positions, max |dNLL|, "
        "mean |dNLL|, retained-set agreement"
    )
    print("\n".join(rows))
    print(f"overall agreement {agreeing / total:.3f}")
    assert agreeing / total >= MIN_AGREEMENT
