"""The architecture matrix (rmm/architectures.py): every causal LM type of transformers' registry, built
tiny and streamed, is exact (against its own forward pass and the reference) or refused, never wrong.

The types come from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` at collection, so a model type that a new
transformers adds gets its own test without a code change. ``python -m rmm.architectures`` prints the
same matrix as a table (docs/models.md).
"""

from __future__ import annotations

import pytest
from conftest import record_max

from rmm.architectures import PASSING, Row, causal_lm_types, classify, main, table, tiny_config

TYPES = causal_lm_types()
# the architectures the harness is documented to support: the matrix must find them exact
SUPPORTED = ("llama", "mistral", "qwen2", "gpt_neox", "gemma3_text")


def test_the_types_come_from_the_registry():
    assert set(SUPPORTED) <= set(TYPES) and len(TYPES) > 100
    assert "bart" not in TYPES  # encoder-decoder types are left out


@pytest.mark.slow  # about 130 s single-threaded for the whole registry (docs/testing.md)
@pytest.mark.parametrize("model_type", TYPES)
def test_an_architecture_is_exact_or_refused(model_type):
    row = classify(model_type)
    assert row.status in PASSING, f"{model_type}: {row.status}: {row.reason}"
    if row.status.startswith("exact"):
        record_max("per-token |dNLL| of the architecture matrix's exact rows, fp32", row.max_dnll)
    if model_type in SUPPORTED:
        assert row.status == "exact", row.reason


def test_tiny_configs_are_small_and_keep_the_layer_kinds():
    config = tiny_config("gemma3_text")  # default: five sliding layers to one global, 26 layers
    assert config.num_hidden_layers == 4 and config.hidden_size == 64 and config.sliding_window == 16
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert tiny_config("gpt2").n_layer == 4  # through the config's attribute_map


def test_the_table_is_sorted_and_counted(tmp_path, capsys):
    rows = [Row("b", "refused", "no | way"), Row("a", "exact", "", 1e-6)]
    text = table(rows, "python -m rmm.architectures")
    assert text.index("| a | exact") < text.index("| b | refused | no / way |")
    assert "2 types: exact: 1, refused: 1" in text and "Made by `python -m rmm.architectures`" in text
    out = tmp_path / "matrix.md"
    assert main(["--types", "gpt2", "--out", str(out)]) == 0
    assert "| gpt2 | refused |" in out.read_text() and "--types gpt2" in out.read_text()
