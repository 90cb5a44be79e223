"""Where a policy's memory goes in the controlled-reuse study: re-stream finished runs with a boundary hook.

    python studies/reuse/reuse_memory.py RUN_DIR [RUN_DIR ...] --out results/cpu/reuse/memory.md

Each run directory's ``config.yaml`` is rebuilt (model, generated streams, policy) and streamed again; the
per-token NLL must equal the stored ``token_nll.parquet`` (else the run is refused: the code changed). At
every decision boundary the retained slots of every (layer, KV head) are classified by the token they hold:
filler, cue, the code of a true record's introduction or echo, the code of a decoy's introduction or echo,
or recall. Reported per run:

- the mean share of retained slots per class, over boundaries, layers and KV heads;
- ``true code kept at recall``: for every true record, at the last boundary before the query that predicts
  its recall's first code token, the share of (layer, KV head) memories holding at least one token of its
  code (from the introduction or the echo), averaged over records;
- ``position 0 kept``: the share of (layer, KV head) memories holding the stream's first token (where
  attention sinks form), over boundaries.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf

from rmm.data import Document, load_documents
from rmm.engine import StreamingEngine
from rmm.lookahead import ReferenceRunner, no_reference_pass
from rmm.memory import SlotMemory
from rmm.model_config import describe_model
from rmm.models import load_model, resolve_device, resolve_dtype
from rmm.policies import make_policy
from rmm.storage import atomic_write_text, read_config, read_metrics, read_tokens

CLASSES = ("filler", "cue", "true intro", "decoy intro", "true echo", "decoy echo", "recall")


def classify(doc: Document) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """Class index per position [n], and per true record (first-code query position, its code positions)."""
    n = doc.tokens.numel()
    classes = np.zeros(n, dtype=np.int64)
    classes[doc.segments == "cue"] = CLASSES.index("cue")
    classes[doc.segments == "recall"] = CLASSES.index("recall")
    event, code_len = doc.meta["event_tokens"], len(doc.meta["records"][0]["code"])
    recalls = []
    for record in doc.meta["records"]:
        kind = "decoy" if record["decoy"] else "true"
        intro = np.arange(record["intro_start"] + event - code_len, record["intro_start"] + event)
        echo = np.arange(record["echo_start"] + event - code_len, record["echo_start"] + event)
        classes[intro] = CLASSES.index(f"{kind} intro")
        classes[echo] = CLASSES.index(f"{kind} echo")
        if record["recall_start"] is not None:
            first_query = record["recall_start"] + event - code_len - 1
            recalls.append((first_query, np.concatenate([intro, echo])))
    return classes, recalls


class CompositionHook:
    """``on_boundary`` hook: class shares of the retained slots, and true-code retention before recalls."""

    def __init__(self, classes: np.ndarray, recalls: list[tuple[int, np.ndarray]], chunk: int):
        self.classes = torch.from_numpy(classes)
        self.recalls, self.chunk = recalls, chunk
        self.shares: list[torch.Tensor] = []
        self.kept_at_recall: list[float] = []
        self.first_kept: list[float] = []  # share of (layer, KV head) memories holding position 0

    def __call__(self, memory: SlotMemory, now: int, evicted: torch.Tensor) -> None:
        held = memory.retained_positions().cpu()  # [L, H, R]
        valid = held >= 0
        cls = self.classes[held.clamp(min=0)]
        counts = torch.stack([((cls == k) & valid).sum() for k in range(len(CLASSES))]).double()
        self.shares.append(counts / valid.sum().clamp(min=1))
        self.first_kept.append(float((held == 0).any(dim=-1).double().mean()))
        for first_query, code in self.recalls:
            if now <= first_query < now + self.chunk:
                holds = torch.isin(held, torch.from_numpy(code)).any(dim=-1)  # [L, H]
                self.kept_at_recall.append(float(holds.double().mean()))


def composition(run_dir: Path, cache: dict[str, Any]) -> dict[str, Any]:
    cfg = OmegaConf.create(read_config(run_dir))
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    key = f"{cfg.model.name}|{device}|{dtype}"
    if key not in cache:
        cache[key] = load_model(cfg.model, device, dtype)
    model, tokenizer = cache[key]
    docs, _ = load_documents(cfg.dataset, tokenizer)
    policy = make_policy(cfg.policy, budget=cfg.budget, chunk=cfg.chunk)
    engine = StreamingEngine(model, policy, positions=cfg.positions, scope=cfg.scope)
    stored = read_tokens(run_dir)
    metrics = read_metrics(run_dir)
    shares, kept, first = [], [], []
    reference = no_reference_pass
    if policy.needs_reference:
        context = metrics["reference_context"] or describe_model(model)["max_position_embeddings"]
        reference = ReferenceRunner(model, cfg.oracle.tau, context)
    for doc in docs:
        policy.prepare(doc.tokens, reference)
        classes, recalls = classify(doc)
        hook = CompositionHook(classes, recalls, policy.chunk)
        result = engine.stream(doc.tokens, on_boundary=hook)
        expected = stored.loc[stored["doc_id"] == doc.doc_id, "nll"].to_numpy(np.float64)[1:]
        if not np.allclose(result.nll.double().numpy(), expected, atol=1e-4, rtol=0):
            raise RuntimeError(f"{run_dir}: re-streaming {doc.doc_id} does not reproduce the stored NLL")
        shares += hook.shares
        kept += hook.kept_at_recall
        first += hook.first_kept
    mean = torch.stack(shares).mean(dim=0).tolist()
    return {
        "run_name": f"{run_dir.parent.name}/{run_dir.name}",  # the setting (seed included) and the run
        **dict(zip(CLASSES, mean, strict=True)),
        "true code kept at recall": float(np.mean(kept)),
        "position 0 kept": float(np.mean(first)),
        "acc_recall": metrics["acc_recall"],
    }


def table(rows: pd.DataFrame) -> str:
    header = ["run", *CLASSES, "true code kept at recall", "position 0 kept", "recall acc"]
    lines = [
        "Where the memory goes (studies/reuse/reuse_memory.py): mean share of the retained slots "
        "holding each "
        "class of token, over decision boundaries, layers and KV heads; `true code kept at recall`: share "
        "of (layer, KV head) memories holding any token of a true record's code (introduction or echo) at "
        "the last boundary before its recall's first code token is predicted, averaged over records; "
        "`position 0 kept`: share of (layer, KV head) memories holding the stream's first token (the "
        "attention sink) over boundaries.",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    for row in rows.itertuples(index=False):
        values = [f"{v:.3f}" for v in row[1:]]
        lines.append(f"| {row[0]} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories of a dataset=reuse study")
    parser.add_argument("--out", type=Path, required=True, help="markdown table to write (and a .csv beside)")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    cache: dict[str, Any] = {}
    rows = pd.DataFrame([composition(run, cache) for run in args.runs])
    atomic_write_text(args.out, table(rows))
    atomic_write_text(args.out.with_suffix(".csv"), rows.to_csv(index=False))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
