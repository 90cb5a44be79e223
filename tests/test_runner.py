"""A run end to end on the embedded default (SmolLM2-135M over Shakespeare), as run.py does it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from rmm.runner import run
from rmm.storage import read_metrics, read_tokens

CONF = str(Path(__file__).resolve().parents[1] / "conf")
PROTOCOL_METRICS = {
    "ppl",
    "nll_mean",
    "n_tokens",
    "n_docs",
    "tokens_per_s",
    "wall_s",
    "peak_memory_bytes",
    "kv_cache_bytes",
    "attended_mean",
    "correct_frac",
    "policy",
    "budget",
    "lag",
    "chunk",
    "positions",
    "model",
    "dataset",
    "seed",
    "git_revision",
    "package_versions",
    "evicted_age_mean",
    "reference_wall_s",
    "estimator_spearman",
}


def config(*overrides: str):
    base = [
        "dataset.n_docs=2",
        "dataset.max_tokens=96",
        "budget=32",
        "chunk=8",
        "wandb.mode=disabled",
        "progress=false",
    ]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=[*base, *overrides])


def test_full_run_reports_the_plain_forward_perplexity(tmp_path):
    metrics = run(config("policy=full"), tmp_path)
    assert PROTOCOL_METRICS <= set(metrics)
    assert metrics == read_metrics(tmp_path)
    tokens = read_tokens(tmp_path)
    assert list(tokens.columns) == ["doc_id", "position", "token_id", "nll", "correct", "segment"]
    assert tokens["segment"].isna().all()  # plain text carries no segment labels
    assert tokens.groupby("doc_id")["position"].min().eq(0).all()
    assert tokens.loc[tokens.position == 0, "nll"].isna().all()
    assert metrics["n_tokens"] == int(tokens.nll.notna().sum()) == 2 * 95
    assert metrics["ppl"] == pytest.approx(math.exp(tokens.nll.astype(float).mean()), rel=1e-6)

    from rmm.models import load_model

    cfg = config("policy=full")
    model, _ = load_model(cfg.model, torch.device("cpu"), torch.float32)
    model.set_attn_implementation("sdpa")
    total = 0.0
    for _, doc in tokens.groupby("doc_id", sort=False):
        ids = torch.tensor(doc.token_id.to_numpy(), dtype=torch.long)[None]
        total += model(ids, labels=ids).loss.item() * (ids.numel() - 1)
    assert metrics["ppl"] == pytest.approx(math.exp(total / metrics["n_tokens"]), rel=1e-5)
    assert metrics["attended_mean"] == pytest.approx(sum(range(96)) / 96)


def test_bounded_run_records_what_protocol_asks(tmp_path):
    metrics = run(config("policy=rmm", "lag=8", "positions=cache", "diagnostics.estimator=true"), tmp_path)
    assert metrics["policy"] == "rmm" and metrics["lag"] == 8 and metrics["policy.weight"] == "correct"
    assert metrics["attended_mean"] < 32
    assert metrics["evicted_age_mean"] > 8  # the provisional buffer is never evicted
    assert -1.0 <= metrics["estimator_spearman"] <= 1.0
    assert metrics["reference_wall_s"] > 0 and metrics["reference_context"] == 96
    assert metrics["kv_cache_bytes"] == 32 * 30 * 3 * 64 * 2 * 4
    assert 0.0 < metrics["correct_frac"] < 1.0


def test_resume_skips_a_complete_run(tmp_path):
    cfg = config("policy=window")
    run(cfg, tmp_path)
    stamp = (tmp_path / "metrics.json").stat().st_mtime_ns
    run(config("policy=window", "progress=true", "wandb.mode=offline"), tmp_path)  # same results config
    assert (tmp_path / "metrics.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match=r"different configuration \(differs in: dataset.max_tokens\)"):
        run(config("policy=window", "dataset.max_tokens=64"), tmp_path)


def test_oracle_reports_its_reference_pass(tmp_path):
    metrics = run(config("policy=oracle"), tmp_path)
    assert metrics["reference_wall_s"] > 0
    with pytest.raises(ValueError, match="exceeds the model's context"):
        run(config("policy=oracle", "oracle.context=100000", "resume=false"), tmp_path)
