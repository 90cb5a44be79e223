"""Experiment tracking with Weights & Biases, the per-position perplexity summary it logs, and a run's
progress bar with its running perplexity.

``Tracker`` knows nothing of policies: it logs whatever config and metrics it is given. W&B is imported only
when the mode is not ``disabled``, so a disabled tracker neither needs W&B nor writes anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from tqdm import tqdm

if TYPE_CHECKING:
    import torch

    from rmm.metrics import RunTotals

MODES = ("offline", "online", "disabled")
POSITION_COLUMNS = ["position_bin_start", "position_bin_end", "ppl", "cum_ppl"]


def position_perplexity(tokens: pd.DataFrame, bins: int = 64) -> pd.DataFrame:
    """Perplexity by stream position, pooled over documents.

    Positions ``0..max(position)`` are cut into at most ``bins`` near-equal integer bins
    ``[position_bin_start, position_bin_end)``. ``ppl`` is exp(mean nll) of the tokens in a bin and
    ``cum_ppl`` exp(mean nll) of all tokens before ``position_bin_end``. Tokens with a null nll (position 0)
    are ignored, and bins without any scored token are dropped.
    """
    if bins < 1:
        raise ValueError("bins must be >= 1")
    scored = tokens.loc[tokens["nll"].notna(), ["position", "nll"]]
    if scored.empty:
        return pd.DataFrame(columns=POSITION_COLUMNS)
    n_positions = int(tokens["position"].max()) + 1
    edges = np.unique(np.linspace(0, n_positions, bins + 1).round().astype(np.int64))
    index = np.searchsorted(edges, scored["position"].to_numpy(np.int64), side="right") - 1
    nll = scored["nll"].to_numpy(np.float64)
    sums = np.bincount(index, weights=nll, minlength=len(edges) - 1)
    counts = np.bincount(index, minlength=len(edges) - 1)
    keep = counts > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        ppl = np.exp(sums / counts)
        cum_ppl = np.exp(np.cumsum(sums) / np.cumsum(counts))
    return pd.DataFrame(
        {
            "position_bin_start": edges[:-1][keep],
            "position_bin_end": edges[1:][keep],
            "ppl": ppl[keep],
            "cum_ppl": cum_ppl[keep],
        }
    )


class Tracker:
    """One W&B run per instance, with files under ``<run_dir>/wandb``.

    ``wandb_cfg`` needs ``mode`` (offline | online | disabled) and may give ``project``, ``entity``,
    ``group`` and ``tags``. Use as a context manager: leaving it by an exception finishes the W&B run as
    failed (exit code 1); leaving it normally without :meth:`finish` closes the run as it stands.
    """

    def __init__(self, wandb_cfg: Mapping[str, Any], run_dir: Path, run_name: str, config: dict[str, Any]):
        self.mode = str(wandb_cfg.get("mode", "offline"))
        if self.mode not in MODES:
            raise ValueError(f"wandb mode must be one of {MODES}, got {self.mode!r}")
        self.run: Any = None
        if self.mode == "disabled":
            return
        import wandb

        run_dir = Path(run_dir)
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=wandb_cfg.get("project"),
            entity=wandb_cfg.get("entity"),
            group=wandb_cfg.get("group"),
            tags=list(wandb_cfg.get("tags") or []),
            name=run_name,
            config=config,
            dir=str(run_dir),
            mode=self.mode,
            reinit="finish_previous",
            settings=wandb.Settings(console="off"),
        )
        self.run.define_metric("running_ppl", step_metric="tokens_seen")
        self._wandb = wandb

    def log_running(self, tokens_seen: int, running_ppl: float) -> None:
        """Log the running perplexity after ``tokens_seen`` scored tokens."""
        if self.run is not None:
            self.run.log({"tokens_seen": int(tokens_seen), "running_ppl": float(running_ppl)})

    def finish(self, metrics: Mapping[str, Any], position_ppl: pd.DataFrame) -> None:
        """Put ``metrics`` in the run summary, log ``position_ppl`` as a table, and close the run."""
        if self.run is None:
            return
        self.run.summary.update(dict(metrics))
        self.run.log({"position_ppl": self._wandb.Table(dataframe=position_ppl.reset_index(drop=True))})
        self._close(exit_code=0)

    def _close(self, exit_code: int) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish(exit_code=exit_code)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._close(exit_code=0 if exc_type is None else 1)


class Progress:
    """A run's progress: a bar over its ``total`` tokens with the running perplexity, logged to ``tracker``
    every ``log_every`` scored tokens. :meth:`chunk_hook` is the engine's per-chunk hook for one document."""

    def __init__(self, total: int, tracker: Tracker, desc: str, disable: bool = False, log_every: int = 512):
        self.bar = tqdm(total=total, unit="tok", disable=disable, desc=desc)
        self.tracker, self.log_every = tracker, log_every

    def chunk_hook(self, totals: RunTotals, doc: object) -> RunningPerplexity:
        """The hook for the document about to stream, after the documents ``totals`` counts."""
        return RunningPerplexity(totals, self.bar, self.tracker, self.log_every)

    def close(self) -> None:
        self.bar.close()


class RunningPerplexity:
    """Per-chunk progress of one document: the bar's token count after every chunk, and the running
    perplexity on the bar and in W&B every ``log_every`` scored tokens. The NLL is summed on its device and
    read only then (reading it after every chunk would make each pass wait for the device), and never
    where neither the bar nor W&B shows it."""

    def __init__(self, totals: RunTotals, progress: tqdm, tracker: Tracker, log_every: int = 512):
        self.totals, self.progress, self.tracker, self.log_every = totals, progress, tracker, log_every
        self.streamed = self.n_scored = 0
        self.last_logged = totals.n_scored
        self.nll_sum: torch.Tensor | float = 0.0
        self.shown = not progress.disable or tracker.run is not None

    def __call__(self, streamed: int, nll: torch.Tensor) -> None:
        """After a chunk: ``streamed`` tokens of the document so far; ``nll`` [Q'] its scored predictions."""
        self.progress.update(streamed - self.streamed)
        self.streamed = streamed
        self.n_scored += nll.numel()
        scored = self.totals.n_scored + self.n_scored
        if not self.shown:
            return
        self.nll_sum = self.nll_sum + nll.double().sum()  # on nll's device: no wait
        if scored - self.last_logged >= self.log_every:
            ppl = math.exp((self.totals.nll_sum + float(self.nll_sum)) / max(scored, 1))
            self.progress.set_postfix(ppl=f"{ppl:.3f}", refresh=False)
            self.tracker.log_running(scored, ppl)
            self.last_logged = scored
