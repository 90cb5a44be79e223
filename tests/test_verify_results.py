"""checks/verify_results.py on a tiny synthetic run: an intact run passes, a perturbed token file fails,
hub models stay out of the pool, and the sample is fixed by the seed and fits the time budget."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import SENTENCES, tiny_model, tiny_tokenizer
from hydra import compose, initialize_config_dir

from checks import verify_results
from rmm.runner import run
from rmm.storage import CONFIG_FILE, TOKENS_FILE

CONF = str(Path(__file__).resolve().parents[1] / "conf")


@pytest.fixture()
def committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run of rmm(correct) on a saved tiny Llama over a textdir of two documents, under ``runs/``."""
    monkeypatch.setenv("RMM_CACHE", str(tmp_path / "cache"))
    tokenizer = tiny_tokenizer()
    model_dir = tmp_path / "model"
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    texts = tmp_path / "texts"
    texts.mkdir()
    words = " ".join(SENTENCES).split()
    rng = random.Random(0)
    for i in range(2):
        (texts / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(50)))
    overrides = [
        "model=local",
        f"model.path={model_dir}",
        "model.name=tiny_llama",
        "dataset=textdir",
        f"dataset.path={texts}",
        "dataset.max_tokens=40",
        "policy=rmm",
        "budget=12",
        "chunk=4",
        "lag=3",
        "device=cpu",
        "dtype=float32",
        "wandb.mode=disabled",
        "progress=false",
    ]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    run_dir = tmp_path / "runs" / "tiny"
    run(cfg, run_dir)
    return run_dir


def test_intact_run_passes_and_perturbed_tokens_fail(committed: Path, tmp_path: Path) -> None:
    out = tmp_path / "verify.md"
    args = [str(committed.parent), "--out", str(out), "--budget-s", "0"]
    assert verify_results.main(args) == 0
    report = out.read_text()
    assert "**PASS**: 1 of 1 runs" in report and "| yes |" in report

    table = pq.read_table(committed / TOKENS_FILE)
    frame = table.to_pandas()
    row = int(frame["nll"].notna().to_numpy().nonzero()[0][5])
    frame.loc[row, "nll"] += 1e-3  # ten times the bound
    pq.write_table(
        pa.Table.from_pandas(frame, schema=table.schema, preserve_index=False), committed / TOKENS_FILE
    )
    assert verify_results.main(args) == 1
    report = out.read_text()
    assert "**FAIL**" in report and "1.00e-03" in report


def test_hub_models_stay_out_of_the_pool(committed: Path) -> None:
    hub = committed.parent / "hub"
    shutil.copytree(committed, hub)
    config = yaml.safe_load((hub / CONFIG_FILE).read_text())
    config["model"].update(source="hub", path=None, hub_id="someone/some-model")
    (hub / CONFIG_FILE).write_text(yaml.safe_dump(config))
    candidates, left_out = verify_results.pool([committed.parent], overhead_s=0.0, max_run_s=None)
    assert [c.run_dir for c in candidates] == [committed]
    assert left_out["not offline"] == 1


def test_sample_is_seeded_and_fits_the_budget() -> None:
    candidates = [
        verify_results.Candidate(Path(f"r{i}"), "h2o", 100, cost) for i, cost in enumerate(range(1, 21))
    ]
    first = verify_results.sample(candidates, seed=3, budget_s=40, n=None)
    assert first == verify_results.sample(list(reversed(candidates)), seed=3, budget_s=40, n=None)
    assert sum(c.cost_s for c in first) <= 40
    assert len(verify_results.sample(candidates, seed=3, budget_s=0, n=4)) == 4


def test_compare_detects_changed_tokens() -> None:
    base = pd.DataFrame(
        {"doc_id": ["a"] * 3, "position": [0, 1, 2], "token_id": [5, 6, 7], "nll": [float("nan"), 1.0, 2.0]}
    )
    base["correct"] = pd.array([None, True, False], dtype="boolean")
    assert verify_results.compare(base, base.copy()) == (0.0, 0)
    flipped = base.copy()
    flipped["correct"] = pd.array([None, True, True], dtype="boolean")
    assert verify_results.compare(base, flipped) == (0.0, 1)
    other = base.assign(token_id=[5, 6, 8])
    assert verify_results.compare(base, other)[0] == float("inf")
