"""Throughput benchmark, everything measured side by side in one process on the same tokens.

    python checks/bench.py [--tokens 8192] [--docs 8] [--batch 4] [--budget 256] [--chunk 64]
    python checks/bench.py --batches 1 2 4 8       # also tokens/s against the batch size
    python checks/bench.py --chunks 64 256 512     # throughput against C, engine and plain forward
    python checks/bench.py --profile --batch 8     # top operators: window, h2o and equal work, side by side
    python checks/bench.py --out results/bench     # also write results/bench/speed_B256_T4096.md
    python checks/bench.py --paired --batch 8 --policies h2o,rmm --repeats 5   # each run beside its yardstick

The engine streams the first ``--tokens`` tokens of the Shakespeare sample as ``--docs`` documents of
equal length, ``--batch`` side by side per forward pass (each with its own memory and decisions).
Prints tokens/s of the engine under every policy (position rules, attention-based and attention-free
score-based policies; expected_attention is attention-free: it records no attention probabilities and
streams on the fused attention path, restkv records them), of a token-by-token physical-eviction loop
(StreamingLLM's evaluation method: one token per forward, KV cache sliced after every step), and of two
yardsticks side by side: plain forward passes over 2048-token windows (no memory bound), and the equal-work
forward (``checks.yardsticks.equal_work``: the model's own forward over the same N x C tokens per pass, N
the batch, with a KV cache cut to the last B - C + 1 keys after every pass, so that every query attends at
most B keys besides its own, as in the engine); then the ratios the project's targets are stated in. With
``--repeats R`` the engine runs and both yardsticks are repeated R times, interleaved (every run once per
round), and each run's fastest round counts, which damps the effect of other load on a shared machine.
With ``--paired`` each engine run is timed next to the equal-work forward at its batch, R times, the
order within a pair alternating, and the ratio of each pair is reported (median and range): the ratio
then no longer depends on what ran earlier in a round or on the machine's speed drifting between runs.

Goals against the equal-work yardstick at the run's own batch, on an idle machine: h2o and rmm at batch 8
>= 0.9x; the position rules (window, streaming_llm) >= 0.95x.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from omegaconf import OmegaConf

from checks.yardsticks import equal_work, plain_forward, token_loop
from rmm import recording
from rmm.data import sample_stream
from rmm.engine import StreamingEngine, StreamRequest
from rmm.files import atomic_write_text
from rmm.models import load_model
from rmm.policies import make_policy

CONF = Path(__file__).resolve().parents[1] / "conf"
# attention-free: no attention probabilities recorded, the fused attention path (expected_attention reads
# queries, keys and values); attention-based: the eager path that records them
ATTENTION_FREE = ("knorm", "keydiff", "lagkv", "expected_attention")
ATTENTION_BASED = ("h2o", "rmm", "tova", "observed_attention", "snapkv", "lru", "restkv")
POLICIES = [  # (name, parameters, positions), measured side by side
    ("window", {}, "original"),
    ("streaming_llm", {}, "original"),
    ("streaming_llm", {}, "cache"),
    ("knorm", {}, "original"),
    ("keydiff", {}, "original"),
    ("lagkv", {}, "original"),
    ("expected_attention", {}, "original"),
    ("h2o", {}, "original"),
    ("tova", {}, "original"),
    ("observed_attention", {}, "original"),
    ("snapkv", {}, "original"),
    ("lru", {}, "original"),
    ("restkv", {}, "original"),
    ("rmm", {"lag": 64}, "original"),
    ("rmm", {"lag": 64}, "cache"),
    ("rmm", {"lag": "auto"}, "original"),
    ("rmm", {"lag": 64, "weight": "gradient"}, "original"),
]
# weight=gradient adds one backward pass per chunk: its cost against rmm(correct) (target <= 3x the time)
GRADIENT, CORRECT = "rmm[gradient]/original", "rmm/original"
AUTO = "rmm[lag=auto]/original"  # the lag chosen online: its rate against rmm at lag 64's


WINDOW_AT_C = "window@C/original"
EQUAL_WORK = "equal_work"  # the equal-work yardstick's rate at the default batch (@bN: at batch N)


def label(name: str, params: dict, positions: str) -> str:
    """The engine run's name: policy[weight]/positions (the weight only when it is not the default;
    ``[lag=auto]`` for the lag chosen online)."""
    weight = f"[{params['weight']}]" if "weight" in params else ""
    auto = "[lag=auto]" if params.get("lag") == "auto" else ""
    return f"{name}{weight}{auto}/{positions}"


def batch_of(key: str, default: int) -> int:
    """The batch of a run's key (``...@bN``: N, else the default batch)."""
    return int(key.split("@b")[1]) if "@b" in key else default


def equal_work_key(batch: int, default: int) -> str:
    """The rates key of the equal-work yardstick at ``batch``."""
    return EQUAL_WORK + ("" if batch == default else f"@b{batch}")


def batch_groups(docs: list[torch.Tensor], batch: int) -> list[torch.Tensor]:
    """``docs`` taken ``batch`` at a time in order, as the engine streams the bench's documents of equal
    length, each group stacked [<= batch, n] (cut to its shortest document): the equal-work input."""
    groups = [docs[i : i + batch] for i in range(0, len(docs), batch)]
    return [torch.stack([doc[: min(d.numel() for d in group)] for doc in group]) for group in groups]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


# the runs whose tokens/s the batch curve (--batches) shows against the batch size
CURVE = [
    ("window", {}, "original"),
    ("streaming_llm", {}, "cache"),
    ("h2o", {}, "original"),
    ("rmm", {"lag": 64}, "original"),
]


def stream_docs(engine: StreamingEngine, docs: list[torch.Tensor]) -> None:
    """Stream ``docs`` through ``engine``, ``engine.options.batch`` per pass, each with its own copy of the
    policy."""
    for _ in engine.stream_many([StreamRequest(doc, copy.copy(engine.policy)) for doc in docs]):
        pass


def stream_peak(n: int, budget: int, chunk: int) -> None:
    """Child process: stream n tokens with ``window`` and print the peak memory as JSON."""
    from rmm.metrics import PeakMemory

    model, tokenizer = load_model(
        OmegaConf.load(CONF / "model/smollm2_135m.yaml"), torch.device("cpu"), torch.float32
    )
    tokens = sample_stream(tokenizer, n)
    memory = PeakMemory(torch.device("cpu"))
    engine = StreamingEngine(model, make_policy({"name": "window"}, budget=budget, chunk=chunk))
    engine.stream(tokens, on_chunk=lambda streamed, nll: memory.sample())
    print(json.dumps({"tokens": tokens.numel(), "peak": memory.bytes()}))


def memory_check(lengths: list[int], budget: int, chunk: int) -> None:
    """Peak memory of whole processes streaming different lengths: it must not grow with the stream."""
    peaks = []
    for n in lengths:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--stream-peak",
                str(n),
                "--budget",
                str(budget),
                "--chunk",
                str(chunk),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        peaks.append(json.loads(out.stdout.strip().splitlines()[-1]))
        mib = peaks[-1]["peak"] / 2**20
        print(f"window B={budget}: {peaks[-1]['tokens']:6d} tokens -> peak RSS {mib:8.1f} MiB")
    print(f"peak ratio longest/shortest stream: {peaks[-1]['peak'] / peaks[0]['peak']:.3f}")


def chunk_sweep(model, tokens: torch.Tensor, chunks: list[int], budget: int) -> None:
    """tokens/s against C for the engine (every policy at decision chunk C) and for plain forward passes
    over C-token windows, side by side; position rules stream in max(C, min(B, 1024))-token passes
    whatever C."""
    n = tokens.numel()
    policies = [
        ("window", {}, "original"),
        ("streaming_llm", {}, "cache"),
        ("h2o", {}, "original"),
        ("rmm", {"lag": 64}, "original"),
    ]
    print(f"chunk sweep: B={budget} for every C, {n} tokens")
    seconds, _ = timed(lambda: plain_forward(model, tokens, 2048))
    forward_2048 = n / seconds
    print(f"plain forward, 2048-token windows  {forward_2048:8.1f} tokens/s")
    header = "".join(f"{f'{name}/{positions}':>22s}" for name, _, positions in policies)
    print(
        f"{'C':>5s}{header}{'forward(C)':>12s}   ratios to forward(C); position rules also to forward(2048)"
    )
    for chunk in chunks:
        rates = []
        for name, params, positions in policies:
            policy = make_policy({"name": name, **params}, budget=budget, chunk=chunk)
            engine = StreamingEngine(model, policy, positions=positions)
            engine.self_check(tokens)  # with the timed stream's probe: not run again inside the timing
            engine.stream(tokens[: 2 * chunk + 1])  # warm-up
            seconds, _ = timed(lambda engine=engine: engine.stream(tokens))
            rates.append((n - 1) / seconds)
        seconds, _ = timed(lambda chunk=chunk: plain_forward(model, tokens, chunk))
        forward = n / seconds
        ratios = " ".join(f"{rate / forward:5.2f}x" for rate in rates)
        to_2048 = " ".join(f"{rate / forward_2048:5.2f}x" for rate in rates[:2])
        print(
            f"{chunk:5d}"
            + "".join(f"{rate:22.1f}" for rate in rates)
            + f"{forward:12.1f}   {ratios} | {to_2048}"
        )


def profile(
    model, docs: list[torch.Tensor], names: list[str], budget: int, chunk: int, batch: int, top: int = 14
) -> None:
    """Where a pass's time goes: each policy of ``names`` streaming ``docs`` ``batch`` per pass, then the
    equal-work yardstick over the same tokens, under torch.profiler (self CPU time per operator, the top
    ``top`` of each and the total), so that the engine's extra operators read off against the model's own."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runs = {}
    for name in names:
        params = next(params for known, params, _ in POLICIES if known == name)  # the table's first
        policy = make_policy({"name": name, **params}, budget=budget, chunk=chunk)
        engine = StreamingEngine(model, policy, batch=batch)
        engine.self_check(docs[0])
        runs[name] = lambda engine=engine: stream_docs(engine, docs)
    groups = batch_groups(docs, batch)
    runs[EQUAL_WORK] = lambda: [equal_work(model, group, budget, chunk) for group in groups]
    n = sum(doc.numel() for doc in docs)
    for name, run in runs.items():
        run()  # warm-up
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            seconds, _ = timed(run)
        events = prof.key_averages()
        total = sum(event.self_cpu_time_total for event in events) / 1e6
        print(
            f"\n{name}, batch {batch}, B={budget}, C={chunk}: {n / seconds:.1f} tokens/s under the profiler, "
            f"{total:.2f} s self CPU time in all"
        )
        print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def paired(
    model, docs: list[torch.Tensor], engines: dict[str, StreamingEngine], args: argparse.Namespace
) -> list[str]:
    """Each engine run timed beside the equal-work forward over the same documents at the same batch,
    ``args.repeats`` pairs each, the order within a pair alternating (engine first in odd pairs). Prints
    every pair; returns the table's rows: per run, the engine's and the yardstick's best rates and the
    median, lowest and highest ratio over its pairs."""
    n = sum(doc.numel() for doc in docs)
    rows = []
    for key, engine in engines.items():
        groups = batch_groups(docs, engine.options.batch)
        work_tokens = sum(x.numel() for x in groups)
        runs = {
            "engine": lambda engine=engine: stream_docs(engine, docs),
            "work": lambda groups=groups: [equal_work(model, x, args.budget, args.chunk) for x in groups],
        }
        rates: dict[str, list[float]] = {"engine": [], "work": []}
        for pair in range(args.repeats):
            for which in ("engine", "work") if pair % 2 == 0 else ("work", "engine"):
                seconds, _ = timed(runs[which])
                rates[which].append((n if which == "engine" else work_tokens) / seconds)
            ratio = rates["engine"][-1] / rates["work"][-1]
            print(
                f"  pair {pair + 1}: {key:28s} {rates['engine'][-1]:8.1f} tokens/s, equal work "
                f"{rates['work'][-1]:8.1f} tokens/s: {ratio:.3f}x",
                flush=True,
            )
        ratios = sorted(e / w for e, w in zip(rates["engine"], rates["work"], strict=True))
        median = statistics.median(ratios)
        rows.append(
            f"| {key} | {engine.options.batch} | {max(rates['engine']):.1f} | {max(rates['work']):.1f} | "
            f"{median:.3f} | {ratios[0]:.3f} | {ratios[-1]:.3f} |"
        )
    return rows


def machine_line(threads: int, load_before: tuple) -> str:
    """The machine a table was measured on: cores, processor, threads, load average before and now."""
    import platform

    return (
        f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), {threads} "
        f"threads; load average {load_before[0]:.2f} before and {os.getloadavg()[0]:.2f} after the run "
        "(1-minute)."
    )


def write_paired(args: argparse.Namespace, n: int, rows: list[str], load_before: tuple) -> None:
    """Print the paired table and, with ``--out``, write it to ``<out>/paired_B<budget>_T<n>_b<batch>.md``."""
    lines = [
        f"# Paired speed: SmolLM2-135M fp32 on CPU, {n} tokens in {args.docs} documents, B={args.budget}, "
        f"C={args.chunk}",
        "",
        f"Command: `python checks/bench.py {' '.join(sys.argv[1:])}`: every engine run timed next to the "
        f"equal-work forward over the same documents at its batch, {args.repeats} pairs each, the order "
        "within a pair alternating.",
        f"{machine_line(args.threads, load_before)} torch {torch.__version__}.",
        "",
        "| run | batch | tokens/s (best) | equal work (best) | ratio, median | lowest | highest |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Goals against equal work (idle machine): h2o and rmm at batch 8 >= 0.9x; position rules (window,",
        "streaming_llm) >= 0.95x.",
    ]
    print("\n".join(lines))
    if args.out:
        path = args.out / f"paired_B{args.budget}_T{n}_b{args.batch}.md"
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "\n".join(lines) + "\n")
        print(f"wrote {path}")


def write_table(
    args: argparse.Namespace,
    n: int,
    rates: dict[str, float],
    attention: dict[str, tuple[bool, int]],
    load_before: tuple,
) -> Path:
    """``<out>/speed_B<budget>_T<tokens>.md``: the machine, the command and every rate with its ratios; and
    ``<out>/speed_points.json``: every engine run as a point for the time model (checks/plan.py)."""
    import platform

    import transformers

    path = args.out / f"speed_B{args.budget}_T{n}.md"
    forward, window_at_c = rates["forward"], rates[WINDOW_AT_C]

    def work(key: str) -> float:  # the equal-work yardstick at the run's batch
        return rates[equal_work_key(batch_of(key, args.batch), args.batch)]

    lines = [
        f"# Speed: SmolLM2-135M fp32 on CPU, {n} tokens in {args.docs} documents, B={args.budget}, "
        f"C={args.chunk}, batch {args.batch}",
        "",
        f"Command: `python checks/bench.py {' '.join(sys.argv[1:])}` (best of {args.repeats} "
        "interleaved rounds, each running every engine, the plain forward passes and the equal-work "
        "forward once).",
        machine_line(args.threads, load_before),
        f"Versions: python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}.",
        "",
        "| run | tokens/s | / plain forward | / equal work | / window in C-token passes |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, rate in rates.items():
        if "@b" not in key:
            lines.append(
                f"| {key} | {rate:.1f} | {rate / forward:.2f} | {rate / work(key):.2f} | "
                f"{rate / window_at_c:.2f} |"
            )
    if args.batches:
        batches = sorted(set(args.batches))
        lines += [
            "",
            f"Batch curve: tokens/s (/ plain forward, / equal work at that batch) against documents per "
            f"forward pass, C={args.chunk}.",
            "",
            "| run | " + " | ".join(f"batch {b}" for b in batches) + " |",
            "|---|" + "---:|" * len(batches),
        ]
        for name, params, positions in CURVE:
            base = label(name, params, positions)
            keys = [base if b == args.batch else f"{base}@b{b}" for b in batches]
            if all(key in rates for key in keys):
                cells = [
                    f"{rates[key]:.1f} ({rates[key] / forward:.2f}x, {rates[key] / work(key):.2f}x)"
                    for key in keys
                ]
                lines.append(f"| {base} | " + " | ".join(cells) + " |")
        works = [rates[equal_work_key(b, args.batch)] for b in batches]
        lines.append(f"| {EQUAL_WORK} | " + " | ".join(f"{w:.1f} ({w / forward:.2f}x)" for w in works) + " |")
    keep = args.budget - args.chunk + 1
    lines += [
        "",
        "plain forward: forward passes over 2048-token windows (no memory bound); equal work: the",
        "model's own forward over the same tokens per pass as the engine (the batch's N documents,",
        f"C = {args.chunk} new tokens each, SDPA) with a KV cache cut to the last B - C + 1 = {keep} keys",
        f"after every pass, so that every query attends at most B = {args.budget} keys besides its own, as",
        "in the engine (checks/yardsticks.py:equal_work); loop: the token-by-token loop with physical",
        "eviction (StreamingLLM's evaluation method); window@C: window streamed in C-token passes like the",
        "score-based policies.",
        "",
        "Goals against equal work at the run's batch (idle machine): h2o and rmm at batch 8 >= 0.9x;",
        "position rules (window, streaming_llm) >= 0.95x.",
    ]
    points = [
        {
            "model": "smollm2_135m",
            "policy": key.split("/")[0].split("[")[0],
            "run": key,
            "positions": key.split("/")[1].split("@")[0],
            "budget": args.budget,
            "chunk": args.chunk,
            "batch": batch_of(key, args.batch),
            "n_docs": args.docs,
            "tokens_per_doc": n // args.docs,
            "threads": args.threads,
            "tokens_per_s": rate,
            "records_attention": attention[key][0],
            "pass_tokens": args.chunk if key == WINDOW_AT_C else attention[key][1],
            "wall_s": n / rate,
        }
        for key, rate in rates.items()
        if "/" in key  # engine runs, not the yardsticks or the loop
    ]
    atomic_write_text(args.out / "speed_points.json", json.dumps(points, indent=1) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n")
    print(f"wrote {path}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in all documents together")
    parser.add_argument("--docs", type=int, default=8, help="documents the tokens are split into")
    parser.add_argument("--batch", type=int, default=4, help="documents per forward pass")
    parser.add_argument(
        "--batches",
        type=int,
        nargs="*",
        metavar="N",
        help="also stream window, streaming_llm, h2o, rmm at batch N",
    )
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of the engine runs")
    parser.add_argument(
        "--policies",
        help="comma-separated engine runs, by policy (h2o) or by run (rmm/original); window always runs",
    )
    parser.add_argument("--only-engine", action="store_true", help="engine runs only (no forward, no loop)")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="only time each engine run at --batch beside the equal-work forward, --repeats pairs each",
    )
    parser.add_argument(
        "--loop-tokens",
        type=int,
        default=None,
        help="tokens for the token-by-token loop (default: all); its rate is per token",
    )
    parser.add_argument(
        "--memory",
        type=int,
        nargs="*",
        metavar="N",
        help="only compare the peak memory of whole processes streaming N tokens (e.g. 4096 32768)",
    )
    parser.add_argument(
        "--chunks",
        type=int,
        nargs="*",
        metavar="C",
        help="only sweep the chunk (e.g. 64 256 512): engine and plain forward at each C, B >= 2 max(C)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="only profile --policies (default window,h2o) at --batch and the equal-work yardstick",
    )
    parser.add_argument("--stream-peak", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="also write the speed table as markdown into this folder")
    args = parser.parse_args()
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    if args.stream_peak:
        return stream_peak(args.stream_peak, args.budget, args.chunk)
    if args.memory:
        return memory_check(sorted(args.memory), args.budget, args.chunk)

    model, tokenizer = load_model(
        OmegaConf.load(CONF / "model/smollm2_135m.yaml"), torch.device("cpu"), torch.float32
    )
    tokens = sample_stream(tokenizer, args.tokens)
    if args.chunks:
        return chunk_sweep(model, tokens, args.chunks, max(args.budget, 2 * max(args.chunks)))
    n = tokens.numel()
    docs = list(tokens.split(-(-n // args.docs)))
    if args.profile:
        names = (args.policies or "window,h2o").split(",")
        return profile(model, docs, names, args.budget, args.chunk, args.batch)
    print(
        f"SmolLM2-135M fp32 on CPU, {args.threads} threads, {n} tokens in {len(docs)} documents, "
        f"B={args.budget}, C={args.chunk}, batch {args.batch}"
    )

    engines = {}
    chosen = set(args.policies.split(",")) | {"window"} if args.policies else None
    runs = [(name, params, positions, args.batch) for name, params, positions in POLICIES]
    runs += [(name, params, positions, b) for b in args.batches or [] for name, params, positions in CURVE]
    for name, params, positions, batch in runs:
        key = label(name, params, positions) + ("" if batch == args.batch else f"@b{batch}")
        if chosen is not None and name not in chosen and key not in chosen:
            continue
        if key in engines:
            continue
        policy = make_policy({"name": name, **params}, budget=args.budget, chunk=args.chunk)
        engines[key] = engine = StreamingEngine(model, policy, positions=positions, batch=batch)
        engine.self_check(tokens)  # the documents joined: the longest probe, not run again while timed
        engine.stream(tokens[: 2 * args.chunk + 1])  # warm-up
    if args.paired:
        equal_work(model, batch_groups(docs, args.batch)[0][:, : 2 * args.chunk + 1], args.budget, args.chunk)
        return write_paired(args, n, paired(model, docs, engines, args), load_before)
    # window again, streamed in passes of C tokens like the score-based policies (position rules normally
    # take max(C, min(B, 1024))-token passes): the ratio to it isolates a policy's own cost from the pass size
    engines[WINDOW_AT_C] = engines["window/original"]
    # the equal-work yardstick at every batch measured, over the same documents taken as the engine takes them
    groups = {
        equal_work_key(b, args.batch): batch_groups(docs, b)
        for b in sorted({args.batch, *(args.batches or [])})
    }
    if not args.only_engine:
        for stacked in groups.values():
            equal_work(model, stacked[0][:, : 2 * args.chunk + 1], args.budget, args.chunk)  # warm-up
    best: dict[str, float] = {}
    forward_s = float("inf")
    work_s: dict[str, float] = {}
    for round_ in range(args.repeats):
        for key, engine in engines.items():
            passes = args.chunk if key == WINDOW_AT_C else recording.POSITION_RULE_CHUNK
            with mock.patch.object(recording, "POSITION_RULE_CHUNK", passes):
                seconds, _ = timed(lambda engine=engine: stream_docs(engine, docs))
            best[key] = min(best.get(key, float("inf")), seconds)
            print(f"  round {round_ + 1}: {key:28s} {(n - 1) / seconds:8.1f} tokens/s", flush=True)
        if not args.only_engine:  # the ceiling, in the same rounds: plain forward passes, 2048-token windows
            seconds, _ = timed(lambda: plain_forward(model, tokens, 2048))
            forward_s = min(forward_s, seconds)
            print(f"  round {round_ + 1}: {'plain forward':28s} {n / seconds:8.1f} tokens/s", flush=True)
            for key, stacked in groups.items():  # and the equal-work forward at every batch
                seconds, _ = timed(
                    lambda stacked=stacked: [equal_work(model, x, args.budget, args.chunk) for x in stacked]
                )
                work_s[key] = min(work_s.get(key, float("inf")), seconds)
                rate = sum(x.numel() for x in stacked) / seconds
                print(f"  round {round_ + 1}: {key:28s} {rate:8.1f} tokens/s", flush=True)
    rates = {key: n / seconds for key, seconds in best.items()}  # every token of every document streamed
    for key, rate in rates.items():
        name, positions = key.split("/")
        print(f"engine {name:22s} positions={positions:12s} {rate:8.1f} tokens/s")
    window, window_at_c = rates["window/original"], rates[WINDOW_AT_C]
    print(
        "\nscore-based policies / window (targets: attention-free >= 0.95x, attention-based >= 0.6x); "
        f"/ window in {args.chunk}-token passes"
    )
    for key, rate in rates.items():
        name = key.split("/")[0].split("[")[0]
        if name in ATTENTION_FREE or name in ATTENTION_BASED:
            family = "attention-free" if name in ATTENTION_FREE else "attention-based"
            print(f"  {key:28s} {rate / window:5.2f}x   {rate / window_at_c:5.2f}x  ({family})")
    if GRADIENT in rates and CORRECT in rates:
        print(
            f"\nrmm weight=gradient: {rates[CORRECT] / rates[GRADIENT]:.2f}x the time per token of "
            "weight=correct (target <= 3x)"
        )
    if AUTO in rates and CORRECT in rates:
        print(f"rmm lag=auto: {rates[AUTO] / rates[CORRECT]:.2f}x the rate of lag 64")
    if args.only_engine:
        return

    rates["forward"] = n / forward_s
    print(f"plain forward, 2048-token windows          {rates['forward']:8.1f} tokens/s")
    for key, seconds in work_s.items():
        rates[key] = sum(x.numel() for x in groups[key]) / seconds
        batch = batch_of(key, args.batch)
        print(f"equal work, batch {batch}, {args.chunk}-token passes   {rates[key]:8.1f} tokens/s")

    loop_tokens = tokens[: args.loop_tokens or n]
    seconds, _ = timed(lambda: token_loop(model, loop_tokens, args.budget, sinks=4))
    rates["loop"] = (loop_tokens.numel() - 1) / seconds
    print(f"token-by-token loop (sinks 4, {loop_tokens.numel()} tokens)  {rates['loop']:8.1f} tokens/s")

    print("\nratios (target: engine >= 15x loop, >= 0.8x forward)")
    for key in ("window/original", "streaming_llm/original", "streaming_llm/cache"):
        if key not in rates:  # left out by --policies
            continue
        print(
            f"  {key:24s} / loop = {rates[key] / rates['loop']:6.1f}x   / forward = "
            f"{rates[key] / rates['forward']:5.2f}x"
        )
    print(
        "\n/ equal work at the run's batch (goals: h2o and rmm at batch 8 >= 0.9x, position rules >= 0.95x)"
    )
    for key, rate in rates.items():
        if "/" in key:  # an engine run
            print(f"  {key:28s} {rate / rates[equal_work_key(batch_of(key, args.batch), args.batch)]:5.2f}x")
    if args.out:
        # per run: whether it records attention, and its tokens per forward pass per document
        attention = {
            key: (engine.plan.recording.record_attention, engine.plan.recording.chunk)
            for key, engine in engines.items()
        }
        write_table(args, n, rates, attention, load_before)


if __name__ == "__main__":
    main()
