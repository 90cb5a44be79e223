"""The same streams under other ATen CPU kernels: how far two machines' runs may differ, measured.

    python checks/capabilities.py [--plays 2] [--tokens 768] [--out results/bench/capabilities.md]

Streams SmolLM2-135M over the first ``--plays`` Shakespeare plays (``--tokens`` each; batch 1) under
h2o and rmm(correct, freeze, lag 32) (B=128, C=16, positions=cache), and rmm(gradient, lag 16) at chunk
1 (B=64, positions=original, at most 300 tokens: a backward pass per token), in one process per kernel
set: ``ATEN_CPU_CAPABILITY`` = default, avx2 and the machine's own (1 thread), and the machine's own with
2 threads. Setting the capability changes the matrix kernels the way another CPU does. Every
computation is compared with the machine's own at 1 thread through :func:`rmm.divergence.diverge`, and
the report gives, per policy and kernel set: perplexity, the largest per-token |dNLL| while the
decisions agree, the largest change of a decision's relative margin while they agree (what
:data:`rmm.divergence.TIE_MARGIN` must exceed), and the first divergence with its cause. Exits 1 when a
divergence is not explained by a near-tie. Writes ``--out`` atomically.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from rmm.divergence import CORRECT_MARGIN, NLL_BOUND, TIE_MARGIN, Trace, diverge
from rmm.files import atomic_write_text

OUT = "results/bench/capabilities.md"
NATURAL = {"budget": 128, "chunk": 16, "positions": "cache"}
POLICIES = {  # label -> rmm.evaluate's options
    "h2o B=128 C=16": {"policy": "h2o", **NATURAL},
    "rmm correct freeze H=32 B=128 C=16": {"policy": "rmm", "lag": 32, "after_commit": "freeze", **NATURAL},
    "rmm gradient H=16 B=64 C=1": {
        "policy": "rmm", "lag": 16, "weight": "gradient", "budget": 64, "chunk": 1, "max_tokens": 300,
    },
}  # fmt: skip
# (label, ATEN_CPU_CAPABILITY or None for the machine's own, threads); the first is the baseline
KERNELS = [
    ("own, 1 thread", None, 1),
    ("own, 2 threads", None, 2),
    ("default", "default", 1),
    ("avx2", "avx2", 1),
]


def worker(plays: int, tokens: int, out_dir: Path, only: str = "") -> None:
    """Stream every policy under this process's kernels; write each token frame to ``out_dir``."""
    import rmm
    from rmm.data import load_documents

    model, tokenizer = rmm.load_model("smollm2_135m", device="cpu")
    data = {"name": "shakespeare", "source": "shakespeare", "n_docs": plays, "max_tokens": tokens}
    docs, _ = load_documents({**data, "min_tokens": 2, "stream": "per_doc"}, tokenizer)
    for i, (label, params) in enumerate(POLICIES.items()):
        if only not in label:
            continue
        evaluation = rmm.evaluate(model, token_ids=[d.tokens for d in docs], batch=1, **params)
        evaluation.tokens.to_parquet(out_dir / f"{i}.parquet")


def score_digits(params: dict) -> int | None:
    """The precision at which the policy of ``params`` (rmm.evaluate's options) compares its scores."""
    from rmm.policies import make_policy

    run_options = ("policy", "budget", "chunk", "positions", "max_tokens")
    options = {k: v for k, v in params.items() if k not in run_options}
    return make_policy({"name": params["policy"], **options}, params["budget"], params["chunk"]).score_digits


def margin_moves(a: Trace, b: Trace) -> float:
    """Largest |relative margin change| of a (layer, head) decision while both kept the same sets."""
    moves = [0.0]
    for t, kept in a.kept.items():
        if b.kept.get(t) != kept:
            break
        x, y = a.decisions[t], b.decisions[t]
        finite = np.isfinite(x) & np.isfinite(y)
        moves.append(float(np.abs(x - y)[finite].max(initial=0.0)))
    return max(moves)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--plays", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--out", type=Path, default=Path(OUT))
    parser.add_argument("--only", default="", help="only the policies whose label contains this")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.plays, args.tokens, args.worker, args.only)
        return 0
    selected = [i for i, label in enumerate(POLICIES) if args.only in label]
    frames: dict[str, dict[int, pd.DataFrame]] = {}
    with tempfile.TemporaryDirectory(prefix="capabilities_") as tmp:
        for label, capability, threads in KERNELS:
            out_dir = Path(tmp) / label.replace(" ", "_").replace(",", "")
            out_dir.mkdir()
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            env.pop("ATEN_CPU_CAPABILITY", None)
            if capability is not None:
                env["ATEN_CPU_CAPABILITY"] = capability
            command = [sys.executable, "-m", "checks.capabilities", "--worker", str(out_dir)]
            command += ["--plays", str(args.plays), "--tokens", str(args.tokens), "--only", args.only]
            subprocess.run(command, env=env, check=True, cwd=Path(__file__).resolve().parents[1])
            frames[label] = {i: pd.read_parquet(out_dir / f"{i}.parquet") for i in selected}
    base = KERNELS[0][0]
    lines = [
        "# The same streams under other ATen CPU kernels (`python checks/capabilities.py`)",
        "",
        f"SmolLM2-135M, {args.plays} Shakespeare plays x {args.tokens} tokens (the gradient weight: 300), "
        f"batch 1; every kernel set against `{base}`. {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load {', '.join(f'{x:.2f}' for x in os.getloadavg())} at the end. "
        f"Bounds (rmm/divergence.py): NLL {NLL_BOUND:g}, decision margin {TIE_MARGIN:g}, "
        f"correct {CORRECT_MARGIN:g}.",
        "",
        "| policy | kernels | ppl | max \\|dNLL\\| while decisions agree | max margin change while agreeing "
        "| first divergence |",
        "|---|---|---:|---:|---:|---|",
    ]
    failed = False
    for i, (policy, params) in enumerate(POLICIES.items()):
        if i not in selected:
            continue
        digits = score_digits(params)
        for label, _, _ in KERNELS:
            frame, reference = frames[label][i], frames[base][i]
            ppl = float(np.exp(frame["nll"].astype("float64").mean()))
            worst, moved, first = 0.0, 0.0, []
            for doc_id, rows in frame.groupby("doc_id", sort=False):
                a = Trace.of_frame(rows, digits)
                b = Trace.of_frame(reference[reference.doc_id == doc_id], digits)
                found = diverge(a, b)
                failed |= not found.ok
                worst, moved = max(worst, found.max_before), max(moved, margin_moves(a, b))
                if found.first is not None:
                    first.append(f"{doc_id}: {found.describe()}")
            cell = "; ".join(first).replace("|", "\\|") or "none"
            lines.append(f"| {policy} | {label} | {ppl:.5f} | {worst:.2g} | {moved:.2g} | {cell} |")
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
