"""What a run reports: aggregation of per-token outcomes and resource measurements."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch


@dataclass
class StreamResult:
    """Per-token outcome of one stream of n tokens.

    nll : [n - 1] float32, -log p(x_{p} | query p-1) for p = 1..n-1.
    correct : [n - 1] bool, argmax of query p-1 equals x_p.
    margin : [n - 1] float32, top-1 minus top-2 log-probability of query p-1: how near ``correct`` was
        to flipping (:mod:`rmm.divergence`).
    boundaries : [K] long, the positions ``now`` of a score-based policy's K decisions.
    decisions : [K, L, H] float32, each decision's relative margin per (layer, KV head)
        (:func:`rmm.policies.select.decision_margin`); K = 0 for a position rule.
    digests : [K, L, H] int64, a fingerprint of the set each decision kept per (layer, KV head)
        (:func:`~rmm.policies.select.kept_digest`).
    score_digits : the significant digits at which the policy compared its scores (None: unrounded).
    """

    nll: torch.Tensor
    correct: torch.Tensor
    attended_total: float
    evicted_age_sum: float
    evicted_count: int
    margin: torch.Tensor | None = None
    boundaries: torch.Tensor | None = None
    decisions: torch.Tensor | None = None
    digests: torch.Tensor | None = None
    score_digits: int | None = None


@dataclass
class RunTotals:
    """Running sums over the documents of a run."""

    nll_sum: float = 0.0
    n_scored: int = 0
    n_correct: int = 0
    n_queries: int = 0
    attended_sum: float = 0.0
    evicted_age_sum: float = 0.0
    n_evicted: int = 0
    n_docs: int = 0
    stream_wall_s: float = 0.0
    reference_wall_s: float = 0.0
    estimator_pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    token_frames: list[pd.DataFrame] = field(default_factory=list)

    def add(
        self,
        doc_id: str,
        tokens: torch.Tensor,
        result: StreamResult,
        wall_s: float,
        segments: np.ndarray | None = None,
    ) -> None:
        self.nll_sum += float(result.nll.double().sum())
        self.n_scored += result.nll.numel()
        self.n_correct += int(result.correct.sum())
        self.n_queries += tokens.numel()
        self.attended_sum += result.attended_total
        self.evicted_age_sum += result.evicted_age_sum
        self.n_evicted += result.evicted_count
        self.n_docs += 1
        self.stream_wall_s += wall_s
        self.token_frames.append(token_frame(doc_id, tokens, result, segments))

    @property
    def running_ppl(self) -> float:
        return math.exp(self.nll_sum / max(self.n_scored, 1))


def token_frame(
    doc_id: str, tokens: torch.Tensor, result: StreamResult, segments: np.ndarray | None = None
) -> pd.DataFrame:
    """One row per token: nll, correct and correct's margin of predicting x_p from query p - 1 (null at
    p = 0), the segment label of x_p (``segments`` [n], null for plain text), and at a boundary p the
    decision's margins and kept-set digests [L * H] (null where none was taken; rmm.divergence)."""
    n = tokens.numel()
    nll = pd.array([None, *result.nll.tolist()], dtype="Float32")
    correct = pd.array([None, *result.correct.tolist()], dtype="boolean")
    segment = pd.array([None] * n if segments is None else list(segments), dtype="string")
    margin = pd.array([None] * n, dtype="Float32")
    if result.margin is not None:
        margin[1:] = result.margin.numpy()
    decision, digest = [None] * n, [None] * n
    if result.boundaries is not None and result.decisions is not None and result.digests is not None:
        for k, now in enumerate(result.boundaries.tolist()):
            decision[now] = result.decisions[k].flatten().numpy()
            digest[now] = result.digests[k].flatten().numpy()
    return pd.DataFrame(
        {
            "doc_id": doc_id,
            "position": range(n),
            "token_id": tokens.tolist(),
            "nll": nll,
            "correct": correct,
            "segment": segment,
            "margin": margin,
            "decision_margins": pd.Series(decision, dtype="object"),
            "decision_digests": pd.Series(digest, dtype="object"),
        }
    ).astype({"position": "int32", "token_id": "int32"})


def segment_metrics(tokens: pd.DataFrame) -> dict[str, float | int]:
    """Per-segment results of a labelled run (empty for plain text).

    ``ppl_<segment>`` for every segment present; over the recall code tokens (segment ``recall``):
    ``nll_recall``/``acc_recall`` (mean NLL, fraction predicted correctly), the same for the first code
    token of each recall (``_first``: it cannot be copied from the cue) and for the others (``_rest``), and
    ``n_recall_tokens``/``n_recalls``.
    """
    if "segment" not in tokens or tokens["segment"].isna().all():
        return {}
    scored = tokens[tokens["nll"].notna()]
    out: dict[str, float | int] = {}
    for segment, group in scored.groupby("segment", sort=True):
        out[f"ppl_{segment}"] = math.exp(float(group["nll"].astype("float64").mean()))
    segment = tokens["segment"]
    recall = (segment == "recall").fillna(False)
    previous = segment.groupby(tokens["doc_id"], sort=False).shift(1)
    first = recall & (previous != "recall").fillna(True)
    for suffix, mask in (("", recall), ("_first", first), ("_rest", recall & ~first)):
        picked = tokens[mask.to_numpy(dtype=bool)]
        if len(picked):
            out[f"nll_recall{suffix}"] = float(picked["nll"].astype("float64").mean())
            out[f"acc_recall{suffix}"] = float(picked["correct"].astype("float64").mean())
    out["n_recall_tokens"] = int(recall.sum())
    out["n_recalls"] = int(first.sum())
    return out


def kv_cache_bytes(
    entries: Sequence[int],
    windows: Sequence[int | None],
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    value_head_dim: int | None = None,
    latent_dim: int | None = None,
    layer_shapes: Sequence[tuple[int, int, int]] | None = None,
) -> dict[str, int]:
    """``kv_cache_bytes``: the past entries each layer holds at most (``entries``, per layer) x kv_heads x
    (head_dim + ``value_head_dim``, default head_dim: K and V) x bytes per element; for a model with
    windowed layers (``windows``: per layer the past entries its window shows, None for a global layer)
    also the part of the global and of the windowed layers (``kv_cache_bytes_global``,
    ``kv_cache_bytes_windowed``). Under multi-head latent attention (``latent_dim``: what the model's own
    cache keeps per token and layer) also ``latent_cache_bytes``: the same entries as that cache stores
    them, one latent each for all heads. ``layer_shapes``: per layer its own (KV heads, key and value head
    dimensions), where layers differ (Gemma 4); each layer's entries are counted at its own shape."""
    size = torch.empty(0, dtype=dtype).element_size()
    shapes = layer_shapes or [(n_kv_heads, head_dim, value_head_dim or head_dim)] * len(entries)
    layer_bytes = [e * h * (d + dv) * size for e, (h, d, dv) in zip(entries, shapes, strict=True)]
    out = {"kv_cache_bytes": sum(layer_bytes)}
    if latent_dim is not None:
        out["latent_cache_bytes"] = sum(entries) * latent_dim * size
    if any(w is not None for w in windows):
        windowed = sum(b for b, w in zip(layer_bytes, windows, strict=True) if w is not None)
        out["kv_cache_bytes_global"] = sum(layer_bytes) - windowed
        out["kv_cache_bytes_windowed"] = windowed
    return out


class PeakMemory:
    """Peak memory of one run: CUDA max allocated on a GPU; on the CPU the largest resident set size
    sampled after every chunk (the process's own high-water mark would carry over between the jobs of
    a sweep that share a process)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.sample()

    def sample(self) -> None:
        if self.device.type != "cuda":
            import psutil  # here: the GPU check runs without it (docs/gpu.md)

            self.peak = max(self.peak, psutil.Process().memory_info().rss)

    def bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        self.sample()
        return self.peak


def estimator_spearman(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
    """Spearman correlation between policy scores at commit and the oracle's future reuse, pooled."""
    if not pairs:
        return None
    scores = torch.cat([p[0] for p in pairs]).double().numpy()
    reuse = torch.cat([p[1] for p in pairs]).double().numpy()
    if len(scores) < 3:
        return None
    from scipy.stats import spearmanr  # here: the GPU check runs without scipy (docs/gpu.md)

    value = spearmanr(scores, reuse).statistic
    return None if math.isnan(value) else float(value)


def summarize(totals: RunTotals) -> dict:
    """The metrics of ``metrics.json`` that come from the stream itself (docs/semantics.md, "What a run
    reports")."""
    return {
        "ppl": totals.running_ppl,
        "nll_mean": totals.nll_sum / max(totals.n_scored, 1),
        "n_tokens": totals.n_scored,
        "n_docs": totals.n_docs,
        "tokens_per_s": totals.n_scored / totals.stream_wall_s if totals.stream_wall_s else None,
        "wall_s": totals.stream_wall_s,
        "reference_wall_s": totals.reference_wall_s or None,
        "attended_mean": totals.attended_sum / max(totals.n_queries, 1),
        "correct_frac": totals.n_correct / max(totals.n_scored, 1),
        "evicted_age_mean": totals.evicted_age_sum / totals.n_evicted if totals.n_evicted else None,
        "n_evicted": totals.n_evicted,
        "estimator_spearman": estimator_spearman(totals.estimator_pairs),
    }
