"""Does a process's first forward pass give what its later ones give? ``--processes`` pairs of fresh
processes each load the model the harness's way and run the same forward pass over ``--tokens`` seeded
random tokens three times: one process loads it without (cold) and the other with (warm)
``rmm.models.warm_vector_math`` first, which ``rmm.models.load_model`` calls. Each prints its passes'
largest per-token |dNLL| from the last pass (0 where bit-identical), the first token where the first pass
differs, how far the first pass's rotary tables (the module named ``rotary_emb``: cos, sin) are from the
last pass's, and whether the first pass's differing cos rows are MKL VML's low-accuracy (EP) cos of the
same angles.

    python -m checks.first_forward --processes 80   # from the repository root

The self-check runs the model's own pass once before the one it holds (rmm/selfcheck.py); docs/testing.md
gives the measured rates.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path

import torch

_VML_ACCURACY = {"HA": 0x2, "EP": 0x3}  # mkl_vml_defines.h: VML_HA, VML_EP


def vml_cos(x: torch.Tensor, accuracy: str) -> torch.Tensor | None:
    """cos of ``x`` (float32) by the MKL VML inside torch's CPU library at ``accuracy`` ("HA", the one
    torch asks for, or "EP"); None where that library exports no ``vmsCos`` (a build without MKL)."""
    try:
        vms_cos = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).vmsCos
    except (OSError, AttributeError):
        return None
    x = x.detach().float().contiguous()
    out = torch.empty_like(x)
    vms_cos(
        ctypes.c_int(x.numel()),
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int64(_VML_ACCURACY[accuracy]),
    )
    return out


def _is_vml_ep(
    module: torch.nn.Module, position_ids: torch.Tensor, first: torch.Tensor, last: torch.Tensor
) -> bool | None:
    """Whether the rows where the first pass's cos [1, P, D] differs from the last's equal VML's EP cos of
    the angles of a Llama-form rotary module (``cat(freqs, freqs)`` of ``inv_freq`` and the positions);
    None where the module has no ``inv_freq`` or torch no VML, or no row differs."""
    rows = ((first - last).abs().amax(-1)[0] > 0).nonzero()[:, 0]
    inv_freq = getattr(module, "inv_freq", None)
    if inv_freq is None or not len(rows):
        return None
    freqs = (inv_freq[None, :, None].float() @ position_ids[:, None, :].float()).transpose(1, 2)
    ep = vml_cos(torch.cat((freqs, freqs), dim=-1), "EP")
    if ep is None:
        return None
    return torch.equal(first[0, rows], (ep * getattr(module, "attention_scaling", 1.0))[0, rows])


def child(model_name: str, n_tokens: int, warm: bool) -> dict[str, float | int | bool | None]:
    """Load ``model_name`` (a shipped config) and compare three forward passes over the same tokens;
    ``warm``: after :func:`rmm.models.warm_vector_math`."""
    from checks.architectures import own_nll  # imports rmm, which makes no call into VML on import
    from rmm import models

    if warm:
        models.warm_vector_math()
    # load_model less its warm-up (cold processes that loaded a saved copy with from_pretrained alone gave
    # 0 of 42: whether what runs before the pass changes the rate is not established, docs/testing.md)
    model, _ = models._load(models.model_config(model_name), torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(model.config.get_text_config().vocab_size, (n_tokens,), generator=generator)
    rotary = [module for name, module in model.named_modules() if name.endswith("rotary_emb")]
    tables: list[tuple[torch.Tensor, ...]] = []  # the rotary module's outputs (cos, sin), one per pass
    positions: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: tuple, kwargs: dict, out: tuple[torch.Tensor, ...]) -> None:
        tables.append(tuple(t.clone() for t in out))
        positions.append(kwargs["position_ids"] if "position_ids" in kwargs else args[1])

    if rotary:
        rotary[0].register_forward_hook(keep, with_kwargs=True)
    nll = [own_nll(model, tokens) for _ in range(3)]
    first, second = ((nll[i] - nll[-1]).abs() for i in (0, 1))
    differs = (first > 0).nonzero()
    cos, sin = ((float((tables[0][i] - tables[-1][i]).abs().max()) if tables else None) for i in (0, 1))
    return {
        "warm": warm,
        "first_vs_last": float(first.max()),
        "second_vs_last": float(second.max()),
        "first_token_differing": int(differs[0, 0]) + 1 if len(differs) else None,
        "rotary_cos_first_vs_last": cos,
        "rotary_sin_first_vs_last": sin,
        "first_cos_is_vml_ep": _is_vml_ep(rotary[0], positions[0], tables[0][0], tables[-1][0])
        if rotary
        else None,
        "threads": torch.get_num_threads(),
    }


def _summary(results: list[dict], arm: str) -> str:
    first = [r for r in results if r["first_vs_last"] > 0]
    later = [r for r in results if r["second_vs_last"] > 0]
    worst = max((r["first_vs_last"] for r in results), default=0.0)
    lines = [
        f"{arm}: the first pass differs from the last in {len(first)} of {len(results)} processes (largest "
        f"|dNLL| {worst:.3g} nats), the second in {len(later)}"
    ]
    lines += [
        f"  from token {r['first_token_differing']}: |dNLL| {r['first_vs_last']:.3g}, rotary cos "
        f"{r['rotary_cos_first_vs_last']}, sin {r['rotary_sin_first_vs_last']}, differing cos rows are VML's "
        f"EP cos: {r['first_cos_is_vml_ep']}"
        for r in first
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=60, help="pairs of processes (cold, warm)")
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.tokens, args.warm)))
        return
    results: dict[bool, list[dict]] = {False: [], True: []}
    command = [sys.executable, "-m", "checks.first_forward", "--child", "--model", args.model, "--tokens"]
    for index in range(args.processes):
        for warm in (False, True):
            arguments = [*command, str(args.tokens), *(["--warm"] if warm else [])]
            out = subprocess.run(arguments, capture_output=True, text=True, check=True)
            results[warm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(index, results[warm][-1], flush=True)
    print(f"{args.model}, {args.tokens} tokens, {results[False][0]['threads']} threads")
    print(_summary(results[False], "cold"))
    print(_summary(results[True], "warm (rmm.models.warm_vector_math first)"))


if __name__ == "__main__":
    main()
