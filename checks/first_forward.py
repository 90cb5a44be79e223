"""Does a process's first forward pass give what its later ones give? Each of ``--processes`` fresh
processes loads the model, runs the same forward pass over ``--tokens`` seeded random tokens three times
and prints each pass's largest per-token |dNLL| from the last one (0 where bit-identical), the first
token where it differs, and how far the first pass's rotary tables (the module named ``rotary_emb``: cos,
sin) are from the last pass's.

    python -m checks.first_forward --processes 80   # from the repository root

The self-check compares the stream with the model's own forward pass and runs that pass once before it
counts (rmm/selfcheck.py): on CPU, in some processes, the first pass differs from every later one
(docs/testing.md gives the measured rate).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch


def child(model_name: str, n_tokens: int) -> dict[str, float | int | None]:
    """Load ``model_name`` and compare three forward passes over the same tokens."""
    from checks.architectures import own_nll  # in the child only: the parent imports no model code
    from rmm.api import load_model

    model, _ = load_model(model_name, device="cpu", dtype="float32")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(model.config.get_text_config().vocab_size, (n_tokens,), generator=generator)
    rotary = [module for name, module in model.named_modules() if name.endswith("rotary_emb")]
    tables: list[tuple[torch.Tensor, ...]] = []  # the rotary module's outputs (cos, sin), one per pass

    def keep(module: torch.nn.Module, args: tuple, out: tuple[torch.Tensor, ...]) -> None:
        tables.append(tuple(t.clone() for t in out))

    if rotary:
        rotary[0].register_forward_hook(keep)
    nll = [own_nll(model, tokens) for _ in range(3)]
    first, second = ((nll[i] - nll[-1]).abs() for i in (0, 1))
    differs = (first > 0).nonzero()
    cos, sin = ((float((tables[0][i] - tables[-1][i]).abs().max()) if tables else None) for i in (0, 1))
    return {
        "first_vs_last": float(first.max()),
        "second_vs_last": float(second.max()),
        "first_token_differing": int(differs[0, 0]) + 1 if len(differs) else None,
        "rotary_cos_first_vs_last": cos,
        "rotary_sin_first_vs_last": sin,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=60)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.tokens)))
        return
    command = [sys.executable, "-m", "checks.first_forward", "--child", "--model", args.model, "--tokens"]
    results = []
    for index in range(args.processes):
        out = subprocess.run([*command, str(args.tokens)], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(index, results[-1], flush=True)
    first = [r for r in results if r["first_vs_last"] > 0]
    later = [r for r in results if r["second_vs_last"] > 0]
    worst = max((r["first_vs_last"] for r in results), default=0.0)
    print(
        f"{args.model}, {args.tokens} tokens, {len(results)} processes, {results[0]['threads']} threads: "
        f"the first pass differs from the last in {len(first)} (largest |dNLL| {worst:.3g} nats), "
        f"the second in {len(later)}"
    )
    for r in first:
        print(
            f"  from token {r['first_token_differing']}: |dNLL| {r['first_vs_last']:.3g}, rotary cos "
            f"{r['rotary_cos_first_vs_last']}, sin {r['rotary_sin_first_vs_last']}"
        )


if __name__ == "__main__":
    main()
