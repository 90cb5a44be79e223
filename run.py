"""Entry point: python run.py [policy=rmm] [lag=64] [budget=256] ... (Hydra overrides; -m for sweeps)."""

import logging

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rmm.runner import run

log = logging.getLogger("rmm")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    metrics = run(cfg, HydraConfig.get().runtime.output_dir)
    log.info(
        "ppl %.4f | %s tokens | %.1f tokens/s | peak memory %.1f MiB | KV cache %.2f MiB",
        metrics["ppl"],
        metrics["n_tokens"],
        metrics["tokens_per_s"] or 0.0,
        metrics["peak_memory_bytes"] / 2**20,
        metrics["kv_cache_bytes"] / 2**20,
    )
    return metrics["ppl"]


if __name__ == "__main__":
    main()
