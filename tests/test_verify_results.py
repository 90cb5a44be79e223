"""checks/verify_results.py on a tiny synthetic run: an intact run passes, a perturbed token file and an
injected bug fail, a near-tie flip passes as a machine divergence, hub models stay out of the pool, and the
sample is fixed by the seed and fits the time budget."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import SENTENCES, tiny_model, tiny_tokenizer
from hydra import compose, initialize_config_dir

from checks import verify_results
from rmm.divergence import NLL_BOUND
from rmm.policies.h2o import H2O
from rmm.runner import run
from rmm.storage import CONFIG_FILE, TOKENS_FILE

CONF = str(Path(__file__).resolve().parents[1] / "conf")


@pytest.fixture()
def committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run of h2o on a saved tiny Llama over a textdir of two documents, under ``runs/``."""
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
        "policy=h2o",
        "budget=12",
        "chunk=4",
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
    assert "**PASS**: 1 of 1 runs agree" in report and "| none |" in report

    table = pq.read_table(committed / TOKENS_FILE)
    frame = table.to_pandas()
    row = int(frame["nll"].notna().to_numpy().nonzero()[0][5])  # before the first eviction (B' = 9)
    frame.loc[row, "nll"] += 10 * NLL_BOUND
    pq.write_table(
        pa.Table.from_pandas(frame, schema=table.schema, preserve_index=False), committed / TOKENS_FILE
    )
    assert verify_results.main(args) == 1
    report = out.read_text()
    assert "**FAIL**" in report and "REGRESSION" in report and f"differs by {10 * NLL_BOUND:.1g}" in report


def test_an_injected_bug_fails(committed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """h2o that forgets the newest candidate's attention (a plausible off-by-one): a regression, even
    though the decisions it changes are clear ones and everything before them agrees."""
    score = H2O.score

    def forgetful(self, state, obs, now):
        scores = score(self, state, obs, now)
        newest = obs.key_pos == obs.key_pos.amax(-1, keepdim=True)
        return torch.where(newest, scores.new_zeros(()), scores)

    monkeypatch.setattr(H2O, "score", forgetful)
    out = tmp_path / "verify.md"
    assert verify_results.main([str(committed.parent), "--out", str(out), "--budget-s", "0"]) == 1
    assert "REGRESSION" in out.read_text()


def test_a_flipped_near_tie_is_a_machine_divergence(committed: Path, tmp_path: Path) -> None:
    """The committed file as another machine could have written it: a near-tie decision (margin below
    TIE_MARGIN) at a boundary that kept other entries there (another digest), and from there on the NLL
    differs by far more than the bound. The same file without the near-tie fails: a clear decision flipped."""
    table = pq.read_table(committed / TOKENS_FILE)
    frame = table.to_pandas()
    doc = frame[frame.doc_id == frame.doc_id.iloc[0]]
    boundary = int(doc.position[doc.decision_margins.notna()].iloc[-3])
    rows = doc.index[doc.position > boundary]  # row p holds query p - 1: the queries that see the decision
    at = doc.index[doc.position == boundary][0]
    digests = frame.at[at, "decision_digests"].copy()
    digests[1] += 1  # the second (layer, head) kept another set
    frame.at[at, "decision_digests"] = digests
    frame.loc[rows, "nll"] += 0.5
    args = [str(committed.parent), "--out", str(tmp_path / "verify.md"), "--budget-s", "0"]
    for margin, verdict in ((1.0, 1), (1e-5, 0)):
        margins = frame.at[at, "decision_margins"].copy()
        margins[1] = margin
        frame.at[at, "decision_margins"] = margins
        pq.write_table(
            pa.Table.from_pandas(frame, schema=table.schema, preserve_index=False), committed / TOKENS_FILE
        )
        assert verify_results.main(args) == verdict
    report = (tmp_path / "verify.md").read_text()
    assert "1 diverge after a near-tie" in report and f"decision at boundary {boundary} kept other" in report
    assert "machine divergence: near-tie decisions there" in report


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
    base["margin"] = pd.array([None, 2.0, 1e-4], dtype="Float32")
    base["decision_margins"] = pd.Series([None, None, None], dtype="object")
    base["decision_digests"] = pd.Series([None, None, None], dtype="object")
    same = verify_results.compare(base, base.copy())
    assert (same.max_diff, same.n_correct_differ, same.regression, same.describe()) == (0.0, 0, False, "")
    flipped = base.copy()
    flipped["correct"] = pd.array([None, True, True], dtype="boolean")  # at a margin of 1e-4: a near-tie
    found = verify_results.compare(base, flipped)
    assert found.n_correct_differ == 1 and not found.regression and "correct near-tie" in found.describe()
    clear = base.copy()
    clear["correct"] = pd.array([None, False, False], dtype="boolean")  # at a margin of 2 nats
    assert verify_results.compare(base, clear).regression
    other = base.assign(token_id=[5, 6, 8])
    assert verify_results.compare(base, other).max_diff == float("inf")
