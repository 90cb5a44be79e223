"""Confidence intervals for a mean over per-token values (documents as clusters, token blocks within them),
and paired comparisons of two runs over the same tokens.

One bootstrap replicate draws ``n_docs`` documents with replacement (the cluster level) and rebuilds each
drawn document, independently per draw, from contiguous blocks of ``block`` tokens taken at random start
positions inside that document (a circular block bootstrap: a block that runs past the document's end
wraps to its start, never into another document). A rebuilt document has exactly its own number of
tokens (``n // block`` whole blocks plus one block of ``n % block`` tokens). The replicate's statistic is
the token-weighted mean over the rebuilt documents, as perplexity pools tokens; the interval is the
percentile interval of the replicates.

Why not ``scipy.stats.bootstrap``: it resamples the observations of a sample i.i.d. (or paired samples
jointly); it cannot draw clusters and then blocks inside each drawn cluster, independently per draw.
The two-level resampler here is a few vectorised numpy lines instead. ``tests/test_compare.py`` checks
that, with one document and ``block=1``, it reproduces ``scipy.stats.bootstrap``'s percentile interval.

Resampling both levels counts the within-document variation on top of the between-document one, so the
interval is on the conservative side when documents are many; with few documents (3 here) the
document level alone would take only a handful of distinct values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

BLOCK = 256
N_RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 0


@dataclass(frozen=True)
class Interval:
    """A mean and its bootstrap percentile interval; ``se`` is the standard deviation of the replicates."""

    estimate: float
    low: float
    high: float
    se: float


def _doc_totals(
    values: np.ndarray, block: int, shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """Sums of independent circular-block rebuilds of one document.

    values: (n,) the document's values in token order. Returns an array of ``shape``: each entry the sum
    of one rebuild of n tokens (``n // L`` blocks of ``L = min(block, n)`` and one of ``n % L``).
    """
    n = len(values)
    length = min(block, n)
    whole, rest = divmod(n, length)
    cumsum = np.concatenate([[0.0], np.cumsum(np.concatenate([values, values[:length]]))])
    starts = np.arange(n)
    block_sums = cumsum[starts + length] - cumsum[starts]  # (n,) sum of the block starting at each token
    totals = block_sums[rng.integers(0, n, size=(*shape, whole))].sum(axis=-1)
    if rest:
        rest_sums = cumsum[starts + rest] - cumsum[starts]
        totals += rest_sums[rng.integers(0, n, size=shape)]
    return totals


def replicate_means(
    values: np.ndarray,
    doc_sizes: np.ndarray,
    block: int = BLOCK,
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
    groups: np.ndarray | None = None,
) -> np.ndarray:
    """Bootstrap replicates of the token-weighted mean (documents, then blocks within each drawn document).

    values: (N,) per-token values, document after document, each document in token order.
    doc_sizes: (D,) number of tokens of each document (positive, summing to N). Returns (n_resamples,).
    groups: optional (D,) label of each document's top cluster (e.g. the generator seed that made it).
    Then a replicate first draws as many groups as there are, with replacement, and within every drawn
    copy of a group as many of its documents as it has, with replacement; blocks within documents as
    before. The resampling depends only on the sizes, groups, block and seed, never on the values, so
    two calls with the same arguments but different values resample the same tokens.
    """
    values = np.asarray(values, dtype=np.float64)
    doc_sizes = np.asarray(doc_sizes, dtype=np.int64)
    if block < 1 or n_resamples < 1:
        raise ValueError(f"block ({block}) and n_resamples ({n_resamples}) must be >= 1")
    if doc_sizes.size == 0 or (doc_sizes < 1).any() or doc_sizes.sum() != values.size:
        raise ValueError(f"doc_sizes {doc_sizes.tolist()[:5]}... must be positive and sum to {values.size}")
    if not np.isfinite(values).all():
        raise ValueError("values must be finite (drop unscored tokens first)")
    rng = np.random.default_rng(seed)
    draws = _doc_draws(doc_sizes.size, groups, n_resamples, rng)  # (R, D)
    numerator = np.zeros(n_resamples)
    for doc, document in enumerate(np.split(values, np.cumsum(doc_sizes)[:-1])):
        count = draws[:, doc]
        copies = int(count.max())
        if copies == 0:
            continue
        totals = _doc_totals(document, block, (n_resamples, copies), rng)  # (R, copies)
        numerator += np.where(np.arange(copies) < count[:, None], totals, 0.0).sum(axis=1)
    return numerator / (draws @ doc_sizes)


def _doc_draws(n_docs: int, groups: np.ndarray | None, n_resamples: int, rng: np.random.Generator):
    """(R, D) how often each document is drawn per replicate: documents with replacement, or, with
    ``groups``, groups with replacement and then documents with replacement within each drawn group."""
    if groups is None:
        return rng.multinomial(n_docs, np.full(n_docs, 1.0 / n_docs), size=n_resamples)
    groups = np.asarray(groups)
    if groups.shape != (n_docs,):
        raise ValueError(f"groups must hold one label per document ({n_docs}), got shape {groups.shape}")
    labels = np.unique(groups)
    group_draws = rng.multinomial(labels.size, np.full(labels.size, 1.0 / labels.size), size=n_resamples)
    draws = np.zeros((n_resamples, n_docs), dtype=np.int64)
    for g, label in enumerate(labels):
        members = np.flatnonzero(groups == label)
        n_members = members.size
        draws[:, members] = rng.multinomial(
            group_draws[:, g] * n_members, np.full(n_members, 1.0 / n_members)
        )
    return draws


def mean_interval(
    values: np.ndarray,
    doc_sizes: np.ndarray,
    block: int = BLOCK,
    n_resamples: int = N_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
    groups: np.ndarray | None = None,
) -> Interval:
    """The token-weighted mean of ``values`` with its percentile interval (see :func:`replicate_means`)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    replicates = replicate_means(values, doc_sizes, block, n_resamples, seed, groups)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(replicates, [alpha, 1.0 - alpha])
    estimate = float(np.asarray(values, dtype=np.float64).mean())
    return Interval(estimate, float(low), float(high), float(replicates.std(ddof=1)))


def scored_tokens(tokens: pd.DataFrame, segment: str | None = None) -> pd.DataFrame:
    """The scored tokens (non-null ``nll``) of a ``token_nll.parquet`` frame, sorted by (doc_id, position).

    With ``segment``, only tokens whose ``segment`` column equals it (a ValueError when the frame has no
    such column or no such token).
    """
    if segment is not None:
        if "segment" not in tokens.columns:
            raise ValueError(
                f"segment={segment!r} asked for, but the token file has no 'segment' column "
                "(only datasets that label segments write one); drop the segment option"
            )
        tokens = tokens[tokens["segment"] == segment]
        if tokens.empty:
            raise ValueError(f"no token has segment {segment!r}")
    scored = tokens[tokens["nll"].notna()]
    return scored.sort_values(["doc_id", "position"], kind="stable").reset_index(drop=True)


def doc_sizes(sorted_tokens: pd.DataFrame) -> np.ndarray:
    """(D,) tokens per document of a frame sorted by ``doc_id`` (as :func:`scored_tokens` returns it)."""
    return sorted_tokens.groupby("doc_id", sort=True).size().to_numpy()


def nll_interval(
    tokens: pd.DataFrame,
    segment: str | None = None,
    block: int = BLOCK,
    n_resamples: int = N_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> Interval:
    """Mean NLL of a run's token frame with its interval; perplexity and its interval are their exp."""
    scored = scored_tokens(tokens, segment)
    if scored.empty:
        raise ValueError("the token frame has no scored token")
    values = scored["nll"].to_numpy(np.float64)
    return mean_interval(values, doc_sizes(scored), block, n_resamples, confidence, seed)


# ---- paired comparisons of two runs over the same tokens ---------------------------------------
KEY_COLUMNS = ("doc_id", "position", "token_id")


class TokenMismatchError(ValueError):
    """Two runs do not score the same token sequence."""


def paired_tokens(tokens_a: pd.DataFrame, tokens_b: pd.DataFrame, segment: str | None = None) -> pd.DataFrame:
    """The scored tokens of two runs side by side: doc_id, position, token_id, nll_a, nll_b.

    Raises TokenMismatchError unless both frames hold the same (doc_id, position, token_id) rows, scored
    (non-null nll) at the same positions, with the same ``segment`` labels where both have that column.
    Sorted by (doc_id, position); with ``segment`` only that segment's tokens.
    """
    keys = list(KEY_COLUMNS)
    if "segment" in tokens_a.columns and "segment" in tokens_b.columns:
        keys.append("segment")
    frames = []
    for tokens in (tokens_a, tokens_b):
        frame = tokens.sort_values(["doc_id", "position"], kind="stable").reset_index(drop=True)
        frames.append(frame.assign(scored=frame["nll"].notna()))
    a, b = frames
    if len(a) != len(b):
        raise TokenMismatchError(
            f"the runs score different token sequences: {len(a)} vs {len(b)} tokens; compare runs of the "
            "same model (tokenizer) and dataset settings (dataset.n_docs, dataset.max_tokens)"
        )
    for column in [*keys, "scored"]:
        same = (a[column] == b[column]).fillna(False).astype(bool) | (a[column].isna() & b[column].isna())
        differs = ~same.to_numpy(dtype=bool)
        if differs.any():
            i = int(np.argmax(differs))
            raise TokenMismatchError(
                f"the runs score different token sequences: first difference in {column!r} at row {i} "
                f"(doc {a.at[i, 'doc_id']!r} position {a.at[i, 'position']}: {a.at[i, column]!r} vs "
                f"{b.at[i, column]!r}); compare runs of the same model (tokenizer) and dataset settings"
            )
    paired = a[keys].assign(nll_a=a["nll"], nll_b=b["nll"], nll=a["nll"])
    scored = scored_tokens(paired, segment)  # the segment filter, nll non-null; order kept
    return scored[[*KEY_COLUMNS, "nll_a", "nll_b"]].astype({"nll_a": np.float64, "nll_b": np.float64})


def compare_tokens(
    tokens_a: pd.DataFrame,
    tokens_b: pd.DataFrame,
    segment: str | None = None,
    block: int = BLOCK,
    n_resamples: int = N_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> dict[str, Any]:
    """Paired comparison of B against A (see the module docstring for the fields)."""
    paired = paired_tokens(tokens_a, tokens_b, segment)
    diff = (paired["nll_b"] - paired["nll_a"]).to_numpy()
    interval = mean_interval(diff, doc_sizes(paired), block, n_resamples, confidence, seed)
    per_doc = pd.Series(diff).groupby(paired["doc_id"].to_numpy(), sort=True).mean()
    return {
        "delta_nll": interval.estimate,
        "ci_low": interval.low,
        "ci_high": interval.high,
        "se": interval.se,
        "ppl_a": float(np.exp(paired["nll_a"].mean())),
        "ppl_b": float(np.exp(paired["nll_b"].mean())),
        "ppl_ratio": float(np.exp(interval.estimate)),
        "ppl_ratio_ci_low": float(np.exp(interval.low)),
        "ppl_ratio_ci_high": float(np.exp(interval.high)),
        "n_tokens": int(len(diff)),
        "n_docs": int(len(per_doc)),
        "docs_b_better": int((per_doc < 0).sum()),
        "docs_a_better": int((per_doc > 0).sum()),
        "docs_tied": int((per_doc == 0).sum()),
        "per_doc_delta_nll": {str(k): float(v) for k, v in per_doc.items()},
        "segment": segment,
        "block": block,
        "n_resamples": n_resamples,
        "confidence": confidence,
        "seed": seed,
    }
