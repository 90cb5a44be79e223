"""Entry point: python run.py [policy=rmm] [lag=64] [budget=256] ... (Hydra overrides; -m for sweeps)."""

import logging
import math
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rmm import provenance
from rmm.config import check_run
from rmm.files import atomic_write_text

log = logging.getLogger("rmm")

ERROR_FILE = "error.txt"  # a failed sweep job's traceback, in its run directory


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """One run; in a sweep (-m) a failing job is logged and recorded in error.txt, and the sweep goes on,
    except a registered run refused for uncommitted code (provenance.require_clean), which ends the sweep."""
    provenance.capture()  # first in a launcher's own job process (submitit); else captured before Hydra
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        checked = check_run(cfg)  # bad input fails here, before transformers is imported or a model loaded
        from rmm.runner import run

        metrics = run(cfg, run_dir, checked)
    except provenance.DirtyTreeError as error:
        log.error("%s", error)
        raise SystemExit(f"refused: {error}") from None  # not one error.txt per job: the whole sweep stops
    except Exception:
        if hydra_cfg.mode != RunMode.MULTIRUN:
            raise
        error_file = run_dir / ERROR_FILE
        log.exception("run %s failed; the sweep goes on (traceback in %s)", cfg.run_name, error_file)
        overrides = " ".join(hydra_cfg.overrides.task)
        atomic_write_text(error_file, f"overrides: {overrides}\n\n{traceback.format_exc()}")
        return math.nan
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    log.info(
        "ppl %.4f | %s tokens | %.1f tokens/s | peak memory %.1f MiB | KV cache %.2f MiB",
        metrics["ppl"],
        metrics["n_tokens"],
        metrics["tokens_per_s"] or 0.0,
        metrics["peak_memory_bytes"] / 2**20,
        metrics["kv_cache_bytes"] / 2**20,
    )
    if "nll_recall" in metrics:  # a labelled (dataset=reuse) run
        log.info(
            "recall: NLL %.3f | accuracy %.3f (first code token %.3f) over %d recalls",
            metrics["nll_recall"],
            metrics["acc_recall"],
            metrics["acc_recall_first"],
            metrics["n_recalls"],
        )
    return metrics["ppl"]


if __name__ == "__main__":
    provenance.capture()  # the code as this process found it, before Hydra composes the config
    main()
