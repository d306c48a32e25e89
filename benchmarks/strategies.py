"""Benchmark: step time and peak memory per process of every training strategy, against one process.

    python benchmarks/strategies.py            # Qwen2 hidden 256, 4 layers, vocab 8192 (7M params), 6 steps
    python benchmarks/strategies.py --quick    # a smaller model, 3 steps
    python benchmarks/strategies.py --large    # ~39M params, states dominate memory (~5 min on 2 CPUs)
    python benchmarks/strategies.py --cases single ddp zero3

Cases (each a separate launch; multi-process cases under ``torchrun`` with
``--nproc_per_node`` processes, gloo on CPU):

* ``single``: ``AccelerateStrategy`` in one process: the baseline.
* ``ddp``: ``AccelerateStrategy`` under torchrun (DDP).
* ``fsdp2``: ``AccelerateStrategy(fsdp=True)`` (torch FSDP2 ``fully_shard``).
* ``zero1`` / ``zero2`` / ``zero3``: ``DeepSpeedStrategy(zero_stage=...)``.

Every case trains the same model on the same global batch (``--batch`` rows
of ``--seq`` tokens, two micro-batches per step, each process its share) with
one thread per process. Step time is the median wall time of the timed steps
on rank 0 after ``--warmup`` untimed ones, so on N free cores the ideal
multi-process ratio is 1/N; other jobs on the machine move it up. Peak memory
is the peak resident set size (``VmHWM``) of each process above its RSS
before the model was built (libraries, process group and a warm-up
forward/backward of a throwaway model excluded), with
``MALLOC_MMAP_THRESHOLD_=1048576`` so freed buffers return to the OS; the
table shows the largest over ranks. "states (theory)" is what parameters,
gradients and AdamW moments alone need per process, in bytes per parameter
(fp32 training, N processes): 16 for one process and DDP (4 weights + 4
gradients + 8 moments), 16/N for FSDP2. DeepSpeed keeps an fp32 master copy of
its partition even when the model itself is fp32 (it is built for bf16/fp16
models), so ZeRO-1 needs 4 + 4 + 12/N, ZeRO-2 4 + 16/N and ZeRO-3 20/N. The
model is built in full on every rank before the strategy shards it (as
``from_pretrained`` does), so that copy is part of every peak; activations
and communication buffers come on top. DeepSpeed's default buckets (5e8
elements for gradient reduction, 5e7 for ZeRO-3 prefetch) are sized for large
models on GPUs: for models this small they hold a full-size copy of the
gradients and parameters as they stream through, which the ZeRO rows include
(they run with the defaults users get; ``reduce_bucket_size`` and
``stage3_prefetch_bucket_size`` in a raw config lower them). Results are printed as a table and written as JSON under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from process_memory import memory_kib, reset_peak

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CASES = ("single", "ddp", "fsdp2", "zero1", "zero2", "zero3")
MODELS = {
    "full": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=688, vocab_size=8192),
    "quick": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=344, vocab_size=4096),
    # ~39M parameters: model states (~600 MiB in one process) dominate the peak.
    "large": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1376, vocab_size=16384),
}


def state_bytes_per_param(case: str, processes: int) -> float:
    """Bytes per parameter for fp32 weights + gradients + AdamW's two moments held by one process."""
    n = 1 if case == "single" else processes
    return {"single": 16.0, "ddp": 16.0, "fsdp2": 16 / n,
            # DeepSpeed adds a 4-byte fp32 master copy of each partition (see the module docstring).
            "zero1": 4 + 4 + 12 / n, "zero2": 4 + 16 / n, "zero3": 20 / n}[case]


# --------------------------------------------------------------------------
# Child: one process of one case
# --------------------------------------------------------------------------


def build_strategy(case: str):
    if case in ("single", "ddp", "fsdp2"):
        from rltk.strategies.accelerate_strategy import AccelerateStrategy

        return AccelerateStrategy(cpu=True, fsdp=case == "fsdp2")
    from rltk.strategies.deepspeed_strategy import DeepSpeedStrategy

    stage = int(case[-1])
    # As in training a large model: every tensor partitioned, not only those above DeepSpeed's 1e5 default.
    config = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else None
    return DeepSpeedStrategy(zero_stage=stage, config=config)


def run_child(case: str, model_name: str, batch: int, seq: int, warmup: int, steps: int, out_file: Path) -> None:
    """Train ``warmup + steps`` steps; write this rank's step times and peak memory to ``out_file``."""
    import torch
    import torch.nn.functional as F
    import transformers

    torch.set_num_threads(1)
    strategy = build_strategy(case)
    rank, world = strategy.rank, strategy.world_size
    if batch % (2 * world):
        raise SystemExit(f"--batch {batch} must split into 2 micro-batches on each of {world} processes")
    # Pay the one-time costs (lazy imports of the model code, autograd and allocator start-up) before
    # the baseline, so the peak measures this case's model, optimizer, gradients and activations.
    warm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
        vocab_size=16))
    warm(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    del warm
    strategy.barrier()
    base_kib = memory_kib()["VmRSS"]
    reset_peak()

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**MODELS[model_name]))
    parameters = sum(p.numel() for p in model.parameters())
    strategy.setup(model, lr=1e-4, total_steps=warmup + steps)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, MODELS[model_name]["vocab_size"], (batch, seq), generator=generator)
    rows = batch // world
    local = input_ids[rank * rows:(rank + 1) * rows]
    global_tokens = batch * (seq - 1)

    times = []
    for step in range(warmup + steps):
        strategy.barrier()
        start = time.perf_counter()
        for i in range(2):
            ids = local[i * rows // 2:(i + 1) * rows // 2]
            with strategy.accumulate(i == 1):
                with strategy.autocast():
                    logits = strategy.model(input_ids=ids).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                       reduction="sum") / global_tokens
                strategy.backward(loss)
        strategy.step()
        strategy.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    peak_mib = (memory_kib()["VmHWM"] - base_kib) / 1024
    peaks = strategy.all_gather_object(peak_mib)
    if rank == 0:
        out_file.write_text(json.dumps({"case": case, "processes": world, "parameters": parameters,
                                        "step_times_s": times, "peak_mib_per_rank": peaks}))
    if hasattr(strategy, "close"):
        strategy.close()
    elif world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------
# Parent: launch every case, collect, compare
# --------------------------------------------------------------------------


def spawn(case: str, args) -> dict:
    """Launch one case (torchrun for several processes) and return its rank-0 record."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "result.json"
        child = [str(Path(__file__).resolve()), "--child", case, "--model", args.model_name, "--batch",
                 str(args.batch), "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps),
                 "--child-out", str(out_file)]
        if case == "single":
            command = [sys.executable, *child]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                       str(args.processes), *child]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576",
               "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rltk" / "torch_extensions"))
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        started = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"case {case} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        record = json.loads(out_file.read_text())
    record["launch_s"] = time.perf_counter() - started
    return record


def summarize(records: dict[str, dict], processes: int) -> dict[str, dict]:
    base = records.get("single")
    summary = {}
    for case, record in records.items():
        step = statistics.median(record["step_times_s"])
        peak = max(record["peak_mib_per_rank"])
        theory_mib = record["parameters"] * state_bytes_per_param(case, processes) / 2**20
        row = {"processes": record["processes"], "step_s": step, "peak_mib": peak, "states_theory_mib": theory_mib,
               "step_times_s": record["step_times_s"], "peak_mib_per_rank": record["peak_mib_per_rank"]}
        if base is not None:
            row["step_ratio"] = step / statistics.median(base["step_times_s"])
            row["peak_ratio"] = peak / max(base["peak_mib_per_rank"])
            row["states_theory_ratio"] = state_bytes_per_param(case, processes) / 16.0
        summary[case] = row
    return summary


def print_table(summary: dict[str, dict]) -> None:
    print(f"\n{'case':<8}{'procs':>6}{'step (s)':>10}{'x single':>10}{'peak/proc (MiB)':>17}{'x single':>10}"
          f"{'states (theory, MiB)':>22}{'x single':>10}")
    for case, row in summary.items():
        ratios = [row.get(k) for k in ("step_ratio", "peak_ratio", "states_theory_ratio")]
        shown = [f"{r:>10.2f}" if r is not None else f"{'-':>10}" for r in ratios]
        print(f"{case:<8}{row['processes']:>6}{row['step_s']:>10.3f}{shown[0]}{row['peak_mib']:>17.1f}{shown[1]}"
              f"{row['states_theory_mib']:>22.1f}{shown[2]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, 3 timed steps")
    parser.add_argument("--large", action="store_true",
                        help="~39M-parameter model whose states dominate the peak (~5 min on 2 CPUs)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), metavar="CASE",
                        help=f"cases to run (default all: {' '.join(CASES)}); 'single' gives the ratios")
    parser.add_argument("--processes", type=int, default=2, help="processes of the multi-process cases")
    parser.add_argument("--batch", type=int, default=8, help="global batch rows per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, help="timed steps (default 6, quick 3)")
    parser.add_argument("--out", type=Path, help="JSON output (default benchmarks/results/strategies-<time>.json)")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--model", dest="model_name", choices=tuple(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        run_child(args.child, args.model_name, args.batch, args.seq, args.warmup, args.steps, args.child_out)
        return

    if args.quick and args.large:
        parser.error("--quick and --large exclude each other")
    args.model_name = "quick" if args.quick else "large" if args.large else "full"
    args.steps = args.steps or (3 if args.quick else 6)
    if args.quick:
        args.seq = min(args.seq, 64)
    print(f"strategies: Qwen2 {MODELS[args.model_name]}, global batch {args.batch} x {args.seq} tokens, "
          f"2 micro-batches, {args.warmup} warm-up + {args.steps} timed steps, {args.processes} processes, "
          "1 thread each")
    records = {}
    for case in args.cases:
        records[case] = spawn(case, args)
        record = records[case]
        print(f"  {case:<7} step {statistics.median(record['step_times_s']):7.3f} s  peak/proc "
              f"{max(record['peak_mib_per_rank']):8.1f} MiB  (launch {record['launch_s']:.0f} s)", flush=True)
    summary = summarize(records, args.processes)
    print_table(summary)
    if "single" not in records:
        print("\n(no 'single' case: ratios omitted)")
    report = {
        "model": MODELS[args.model_name], "parameters": next(iter(records.values()))["parameters"],
        "batch": args.batch, "seq": args.seq, "warmup": args.warmup, "steps": args.steps,
        "processes": args.processes, "summary": summary,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    out = args.out or RESULTS_DIR / f"strategies-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
