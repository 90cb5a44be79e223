"""The self-check's rounding on Gemma 3 270M, where generator seed 12 was refused (docs/confirmation.md).

    python -m studies.confirm.selfcheck_rounding [--seed 12] [--cell W2] [--out DIR]

For every stream of a registered cell at one generator seed: the self-check's probe (rmm/selfcheck.py) and
its reverse, each streamed alone with an unlimited budget under h2o's plan, against the model's own forward
of that row: the largest per-token |dNLL| in fp32 and fp64, at positions ``original`` (the model's rotated
keys kept as they are) and ``cache`` (keys stored unrotated and rotated again by rmm's tables); and, in
fp32, the largest |dNLL| of each row streamed beside the other in one batch against the row alone. Writes
``selfcheck_rounding.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rmm import selfcheck
from rmm.data import load_documents
from rmm.engine import StreamingEngine
from rmm.files import atomic_write_text
from rmm.models import load_model
from rmm.options import POSITIONS
from rmm.policies import make_policy
from studies.confirm.confirm import cell_config

MODEL = "gemma3_270m"
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def measure(cell: str, seed: int) -> list[str]:
    """Markdown rows: stream | row | |dNLL| per dtype and position mode | batch of two against alone."""
    cfg = cell_config(MODEL, cell, seed, "policy=h2o")
    model, tokenizer = load_model(cfg.model, torch.device("cpu"), torch.float32)
    docs, _ = load_documents(cfg.dataset, tokenizer)
    policy = make_policy(cfg.policy, budget=cfg.budget, chunk=cfg.chunk)
    found: dict[tuple[str, str, str, int], float] = {}
    batched: dict[tuple[str, int], float] = {}
    for dtype_name, dtype in DTYPES.items():
        model = model.to(dtype)
        for positions in POSITIONS:
            engine = StreamingEngine(model, policy, positions=positions)
            for doc in docs:
                probe = doc.tokens[: selfcheck.probe_length(engine, doc.tokens.numel())]
                for row, tokens in enumerate((probe, probe.flip(0))):
                    difference = selfcheck.check_stream(engine, tokens)[0]
                    found[(dtype_name, positions, doc.doc_id, row)] = float(difference.max())
                if dtype == torch.float32 and positions == "cache":
                    pair = StreamingEngine(model, policy, positions=positions, batch=2)
                    in_batch = selfcheck.check_stream(pair, probe)[2]
                    for row in (0, 1):
                        batched[(doc.doc_id, row)] = float(in_batch[row].max())
    rows = []
    for doc in docs:
        for row, name in enumerate(("probe", "reverse")):
            cells = [f"{found[(d, p, doc.doc_id, row)]:.2e}" for d in DTYPES for p in POSITIONS]
            rows.append(f"| {doc.doc_id} | {name} | {' | '.join(cells)} | {batched[(doc.doc_id, row)]:.2e} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="W2")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    head = " | ".join(f"{d}, {p}" for d in DTYPES for p in POSITIONS)
    lines = [
        f"# The self-check's rounding on Gemma 3 270M: cell {args.cell}, generator seed {args.seed}",
        "",
        "Largest per-token |dNLL| (nats) of each row streamed alone with an unlimited budget against the "
        "model's own forward of that row, and (last column, fp32, positions=cache) of each row streamed "
        "beside the other in one batch against the row alone. The self-check's fp32 tolerance is "
        f"{selfcheck.TOLERANCE[torch.float32]:g}.",
        "From `python -m studies.confirm.selfcheck_rounding --cell "
        f"{args.cell} --seed {args.seed} --out results/cpu/confirm`.",
        "",
        f"| stream | row | {head} | fp32 batch of two vs alone |",
        "|---|---|" + "---|" * (len(DTYPES) * len(POSITIONS) + 1),
        *measure(args.cell, args.seed),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        atomic_write_text(args.out / "selfcheck_rounding.md", text)


if __name__ == "__main__":
    main()
