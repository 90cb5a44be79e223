"""Bad input fails in seconds: every case runs ``python run.py`` as a whole process and is timed.

    python checks/bad_inputs.py [--limit 5.0]

For each case prints the wall time of the whole process (interpreter start, imports, Hydra composition,
the check, the message), whether it failed with the expected message, and the message's last line.
Exits 1 when a case does not fail, fails with another message, or takes longer than ``--limit`` seconds.
The cases run with W&B's key unset and a fresh HOME, so that ``wandb.mode=online`` has no key.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (overrides, a fragment the error message must contain); {home} is the cases' fresh HOME, holding an
# empty folder ``empty``
CASES: list[tuple[list[str], str]] = [
    (["positions=absolute"], "positions must be one of"),
    (["scope=row"], "scope must be one of"),
    (["budget=0"], "budget must be an integer >= 1"),
    (["budget=64", "chunk=128"], "set chunk<=64"),
    (["lag=-1"], "lag must be an integer >= 0"),
    (["dtype=float8"], "dtype must be one of"),
    (["oracle.tau=0"], "oracle.tau must be > 0"),
    (["device=tpu"], "device must be auto, cpu, cuda or cuda:N"),
    (["device=cuda"], "run with device=cpu or device=auto"),
    (["wandb.mode=online"], "wandb.mode=offline"),
    (["wandb.mode=cloud"], "wandb.mode must be one of"),
    (["policy=rmm", "lag=300"], "must be smaller than the room at a boundary"),
    (["policy.weight=maybe"], "policy.weight must be one of"),
    (["policy=snapkv", "policy.kernel=4"], "policy.kernel must be an odd integer"),
    (["policy=oracle", "policy.variant=psychic"], "policy.variant must be one of"),
    (["dataset.max_tokens=0"], "dataset.max_tokens must be an integer >= 1"),
    (["dataset=reuse", "dataset.echo_gap=-1"], "echo_gap"),
    (["dataset=reuse", "dataset.max_tokens=100"], "raise dataset.max_tokens"),
    (["dataset=textdir"], "dataset.path"),
    (["dataset=textdir", "dataset.path=/no/such/folder"], "no such folder"),
    (["dataset=pg19", "dataset.local_path=/no/such/mirror"], "no such file or folder"),
    (["dataset=textdir", "dataset.path={home}/empty"], "no .txt/.md files under it"),
    (["dataset.max_tokens=64", "dataset.min_tokens=128"], "raise dataset.max_tokens or lower"),
    (["budget=null"], "policy rmm needs a budget: set budget=N"),
    (["policy=h2o", "policy.rho=abc"], "policy.rho must be a number"),
]


def run_case(overrides: list[str], home: str) -> tuple[float, int, str]:
    """(wall seconds, exit code, combined output) of ``python run.py <overrides>``."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "NETRC")}
    env.update(HOME=home, HYDRA_FULL_ERROR="0")
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "run.py", *overrides, "hydra.run.dir=" + os.path.join(home, "run")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return time.perf_counter() - start, result.returncode, result.stdout + result.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=float, default=5.0, help="seconds a case may take (default 5)")
    args = parser.parse_args(argv)
    failures = 0
    print(f"{'seconds':>8s}  {'ok':3s}  overrides -> message")
    with tempfile.TemporaryDirectory() as home:
        os.mkdir(os.path.join(home, "empty"))
        for overrides, expected in CASES:
            seconds, code, output = run_case([o.replace("{home}", home) for o in overrides], home)
            lines = [line for line in output.strip().splitlines() if line.strip()]
            message = next((line for line in reversed(lines) if expected in line), lines[-1] if lines else "")
            ok = code != 0 and expected in output and seconds <= args.limit
            failures += not ok
            case = " ".join(overrides)
            print(f"{seconds:8.2f}  {'yes' if ok else 'NO':3s}  {case} -> {message.strip()[:160]}")
    print(f"{len(CASES) - failures} of {len(CASES)} cases fail with their message in <= {args.limit:g} s")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
