"""Re-make one document of a committed run with one threshold comparison flipped, to test which near-tie at
tau explains a divergence from the committed token file (docs/semantics.md, "Batches").

    python checks/threshold_flip.py RUN_DIR DOC LAYER HEAD QUERY KEY

The comparison is a_QUERY(KEY) >= tau in (LAYER, KV head HEAD): lru's use of the key (the stream's own
attention) or the oracles' request (the reference pass's). The document is streamed twice at batch 1, as it
is and with that one comparison going the other way; printed: the statistic and its distance from tau, the
first boundary whose kept sets differ between the two, and each stream's largest |dNLL| against the
committed file with the first query past rmm.divergence.NLL_BOUND.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from checks.verify_results import recompose
from rmm.config import check_run
from rmm.divergence import NLL_BOUND
from rmm.future import FutureRequests
from rmm.runner import build
from rmm.storage import read_config, read_tokens


def flipped_lru(policy, where: tuple[int, int, int, int], seen: list[float]):
    """A copy of the lru ``policy`` whose comparison at ``where`` (layer, head, query, key) flips."""
    layer, head, query, key = where

    class Flipped(type(policy)):
        def observe(self, state, obs):
            q, s = (obs.query_pos == query).nonzero(), (obs.key_pos[layer, head] == key).nonzero()
            if len(q) and len(s):
                attention = obs.attention.clone()
                value = float(attention[layer, head, q[0, 0], s[0, 0]])
                seen.append(value)
                attention[layer, head, q[0, 0], s[0, 0]] = self.tau / 2 if value >= self.tau else 2 * self.tau
                obs.attention = attention
            super().observe(state, obs)

    return Flipped(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init})


def flipped_future(
    future: FutureRequests, where: tuple[int, int, int, int], seen: list[float]
) -> FutureRequests:
    """``future`` with the request of ``where`` (layer, head, query, key) removed, or added at tau."""
    layer, head, query, key = where
    n = future.n_tokens
    code = ((layer * future.n_heads + head) * n + key) * n + query
    codes, mass = future.recorded()
    seen.extend(mass[codes == code].tolist())
    hit = (codes == code) & (mass >= future.tau)
    if hit.any():
        codes, mass = codes[~hit], mass[~hit]
    else:
        codes, mass = (
            torch.cat([codes[codes != code], torch.tensor([code])]),
            torch.cat([mass[codes != code], torch.tensor([future.tau])]),
        )
    shape = (future.n_layers, future.n_heads, n)
    return FutureRequests(*shape, codes, mass.float(), future.query_weights, future.tau)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("doc", help="the document's doc_id")
    parser.add_argument("where", type=int, nargs=4, metavar="LAYER HEAD QUERY KEY")
    args = parser.parse_args()
    cfg = OmegaConf.create(recompose(read_config(args.run_dir)))
    cfg.batch = 1  # the document streamed alone
    setup = build(cfg, check_run(cfg))
    doc = next(d for d in setup.docs if d.doc_id == args.doc)
    stored = read_tokens(args.run_dir)
    committed = stored[stored.doc_id == args.doc].sort_values("position")["nll"].to_numpy(np.float64)[1:]
    engine = setup.engine
    seen: list[float] = []
    kept = []
    for flip in (False, True):
        policy = copy.copy(setup.policy)
        if flip and setup.policy.name == "lru":
            policy = flipped_lru(policy, tuple(args.where), seen)
        policy.prepare(doc.tokens, setup.reference)
        if flip and setup.policy.name == "oracle":
            policy.future = flipped_future(policy.future, tuple(args.where), seen)
        sets: dict[int, list] = {}

        def hook(view, now: int, evicted: torch.Tensor, sets: dict = sets) -> None:
            sets[now] = view.retained_positions().tolist()

        engine.policy = policy
        nll = engine.stream(doc.tokens, on_boundary=hook).nll.double().numpy()
        kept.append(sets)
        diff = np.abs(nll - committed)
        past = np.flatnonzero(diff > NLL_BOUND)
        print(
            f"{'flipped' if flip else 'as is'}: max |dNLL| against the committed file {diff.max():.2g}, "
            f"first query past {NLL_BOUND:g}: {past[0] if past.size else 'none'}"
        )
    tau = setup.reference.tau if setup.reference is not None else setup.policy.tau
    for value in seen[:1]:
        print(f"statistic {value!r}, tau {tau}: |a/tau - 1| = {abs(value / tau - 1):.2g}")
    first = min((t for t in kept[0] if kept[0][t] != kept[1].get(t)), default=None)
    print(f"first boundary whose kept sets differ: {first}")


if __name__ == "__main__":
    main()
