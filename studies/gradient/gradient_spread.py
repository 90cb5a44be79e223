"""How reproducible rmm's gradient weight is in fp32: one run at 1 and 2 threads, and against the reference.

    python -m studies.gradient.gradient_spread [--tokens 300] [--budget 64] [--lag 16] [--chunks 1 16]

``weight=gradient`` with ``accumulate`` sums signed first-order utilities u_s(j) whose rankings can be
decided by float rounding; rounding differs with the number of threads (PyTorch splits reductions by
thread) and between the engine (fp32) and the reference (:mod:`rmm.reference`, float64 sums). This runs,
on SmolLM2-135M (fp32, CPU) over the first ``--tokens`` tokens of the Shakespeare sample, original
positions, for each chunk C, after_commit accumulate and freeze:

- the engine at 1 thread and at 2 threads;
- the reference (token by token, physical eviction), whose gradient is taken at the same chunk boundaries.

Printed per run: perplexity, the first query whose retained sets differ from the 1-thread engine's, and
the largest per-token |NLL difference|. ``weight=correct`` runs alongside as the control (its decisions
do not hinge on rounding). The spread is then set against the committed gradient results' effect sizes in
docs/results.md.
"""

from __future__ import annotations

import argparse
import math

import torch
from omegaconf import OmegaConf

from rmm.data import sample_stream
from rmm.engine import StreamingEngine, retained_sets_recorder
from rmm.files import config_dir
from rmm.models import load_model
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream


def engine_run(model, tokens: torch.Tensor, params: dict, budget: int, chunk: int, threads: int):
    """(nll [n-1], retained sets per query) of the engine at ``threads`` threads."""
    torch.set_num_threads(threads)
    hook, sets = retained_sets_recorder()
    policy = make_policy({"name": "rmm", **params}, budget=budget, chunk=chunk)
    result = StreamingEngine(model, policy).stream(tokens, on_boundary=hook)
    return result.nll.double(), sets


def first_split(sets: dict[int, list], other: dict[int, list]) -> int | None:
    """The first boundary whose retained sets differ (None: identical at every boundary)."""
    return next((now for now in sorted(sets) if sets[now] != other.get(now, sets[now])), None)


def ppl(nll: torch.Tensor) -> float:
    return math.exp(float(nll.mean()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--lag", type=int, default=16)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    model, tokenizer = load_model(
        OmegaConf.load(config_dir() / "model/smollm2_135m.yaml"), torch.device("cpu"), torch.float32
    )
    tokens = sample_stream(tokenizer, args.tokens)
    print(
        f"SmolLM2-135M fp32, {tokens.numel()} Shakespeare tokens, B={args.budget}, H={args.lag}, original "
        f"positions; torch {torch.__version__}"
    )
    print("| weight | after_commit | C | engine 1 thread | engine 2 threads | reference | 2 threads vs 1: "
          "first split, max dNLL | reference vs engine 1: first split, max dNLL |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---|---|")
    for chunk in args.chunks:
        for weight in ("gradient", "correct"):
            for after in ("accumulate", "freeze"):
                params = {"lag": args.lag, "weight": weight, "after_commit": after}
                one, one_sets = engine_run(model, tokens, params, args.budget, chunk, threads=1)
                two, two_sets = engine_run(model, tokens, params, args.budget, chunk, threads=2)
                torch.set_num_threads(2)
                spec = ReferenceSpec(policy="rmm", budget=args.budget, chunk=chunk, **params)
                ref, _ = reference_stream(model, tokens, spec)
                ref, ref_sets = ref.double(), {now: spec.retained_log[now] for now in one_sets}
                print(
                    f"| {weight} | {after} | {chunk} | {ppl(one):.3f} | {ppl(two):.3f} | {ppl(ref):.3f} "
                    f"| {first_split(two_sets, one_sets)}, {float((two - one).abs().max()):.2e} "
                    f"| {first_split(ref_sets, one_sets)}, {float((ref - one).abs().max()):.2e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
