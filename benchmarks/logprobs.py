"""Benchmark: fused token log-probs + entropy against full logits and the bare matmul.

    python benchmarks/logprobs.py            # N=8192 D=512 V=32000 fp32, 3 rounds, plus a scaling sweep
    python benchmarks/logprobs.py --quick    # a smaller shape, 1 round, short sweep

Cases (each in its own subprocess, so peak memory is that case's alone):

* ``matmul``: ``hidden @ weight.T`` (forward) and its two gradient matmuls
  (forward+backward): the floor, since every method must compute these products.
* ``naive``: full fp32 logits, ``log_softmax``, gather, entropy (``impl="naive"``).
* ``torch``: the chunked torch backend (``impl="torch"``).
* ``triton``: only when CUDA is present (timed with CUDA events against ``torch``).

Memory is the peak resident set size above the inputs (``VmHWM`` reset through
``/proc/self/clear_refs``) with ``MALLOC_MMAP_THRESHOLD_=1048576`` so freed
buffers go back to the OS; backward counts the parameter gradients it creates.
Times are medians of wall time and of process CPU time: other jobs share the
cores, so the cases run interleaved, round after round, every ratio is taken
from the same run, and the CPU-time ratios (work done, not waiting for a core)
are the steadier of the two. Results are printed as a table and written as
JSON under ``benchmarks/results/``. The targets are stated for the full shape;
``--quick`` runs a shape whose logits fit in one default tile.

Targets from issue 4 (ratios on this CPU): forward peak <= 1/8 of naive,
forward+backward peak <= 1/6 of naive, forward time <= 1.3x matmul,
forward+backward time <= naive; memory flat in V for a fixed chunk size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from process_memory import memory_kib, reset_peak

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CPU_CASES = ("matmul", "naive", "torch")
MODES = ("fwd", "fwd+bwd")


# --------------------------------------------------------------------------
# Child process: one case, one shape
# --------------------------------------------------------------------------


def run_child(case: str, mode: str, n: int, d: int, v: int, repeats: int, chunk: list[int] | None) -> dict:
    """Time one case ``repeats`` times in this process; peak extra memory per run in MiB."""
    import torch

    from rltk.kernels import token_logprobs_and_entropy

    torch.manual_seed(0)
    backward = mode == "fwd+bwd"
    hidden = torch.randn(n, d).requires_grad_(backward)
    weight = (torch.randn(v, d) * d**-0.5).requires_grad_(backward)
    labels = torch.randint(0, v, (n,))
    chunk_size = tuple(chunk) if chunk else None

    def run():
        if case == "matmul":
            logits = hidden @ weight.T
            if backward:
                logits.backward(torch.ones_like(logits))
            return logits
        logprobs, entropy = token_logprobs_and_entropy(hidden, weight, labels, impl=case, chunk_size=chunk_size)
        if backward:
            (logprobs.sum() + 0.1 * entropy.sum()).backward()
        return logprobs

    # Library start-up (thread pools, MKL) on a small copy, so it is not timed.
    small = min(n, 256)
    for _ in range(2):
        warm_h = hidden.detach()[:small].clone().requires_grad_(backward)
        warm_w = weight.detach()[:small].clone().requires_grad_(backward)
        if case == "matmul":
            warm_out = warm_h @ warm_w.T
            if backward:
                warm_out.sum().backward()
        else:
            warm_lp, warm_ent = token_logprobs_and_entropy(warm_h, warm_w, labels[:small] % small, impl=case)
            if backward:
                (warm_lp.sum() + warm_ent.sum()).backward()
    del warm_h, warm_w

    times, cpu_times, peaks = [], [], []
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        reset_peak()
        base = memory_kib()["VmRSS"]
        start, cpu_start = time.perf_counter(), time.process_time()
        out = run()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        peaks.append((memory_kib()["VmHWM"] - base) / 1024)
        del out
    return {"case": case, "mode": mode, "N": n, "D": d, "V": v, "chunk_size": chunk,
            "times_s": times, "cpu_times_s": cpu_times, "peaks_mib": peaks}


# --------------------------------------------------------------------------
# Parent: interleaved rounds, sweep, table, JSON
# --------------------------------------------------------------------------


def spawn(case, mode, n, d, v, repeats, chunk=None) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--child", case, mode, str(n), str(d), str(v), str(repeats)]
    if chunk:
        cmd += ["--chunk", *map(str, chunk)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark child {cmd[2:]} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def median_of(records: list[dict], key: str) -> float:
    return statistics.median(x for r in records for x in r[key])


def main_comparison(n, d, v, rounds, repeats) -> dict:
    """Every CPU case x mode, ``rounds`` times, in rotating order; medians per case."""
    records: dict[tuple[str, str], list[dict]] = {(c, m): [] for c in CPU_CASES for m in MODES}
    order = [(c, m) for m in MODES for c in CPU_CASES]
    for r in range(rounds):
        rotated = order[r % len(order):] + order[: r % len(order)]
        for case, mode in rotated:
            rec = spawn(case, mode, n, d, v, repeats)
            records[(case, mode)].append(rec)
            print(f"  round {r + 1}/{rounds} {case:>6} {mode:<7} time {statistics.median(rec['times_s']):7.3f} s "
                  f"cpu {statistics.median(rec['cpu_times_s']):7.3f} s  peak {max(rec['peaks_mib']):8.1f} MiB",
                  flush=True)
    summary = {}
    for (case, mode), recs in records.items():
        summary[f"{case}/{mode}"] = {
            "time_s": median_of(recs, "times_s"),
            "cpu_time_s": median_of(recs, "cpu_times_s"),
            "peak_mib": median_of(recs, "peaks_mib"),
            "runs": [{k: r[k] for k in ("times_s", "cpu_times_s", "peaks_mib")} for r in recs],
        }
    return summary


def ratios(summary: dict) -> dict:
    """Ours over the baselines: memory, wall time, and CPU time (steadier when the cores are shared)."""
    s = lambda key, field: summary[key][field]  # noqa: E731
    out = {
        "fwd_peak_torch_over_naive": s("torch/fwd", "peak_mib") / s("naive/fwd", "peak_mib"),
        "fwdbwd_peak_torch_over_naive": s("torch/fwd+bwd", "peak_mib") / s("naive/fwd+bwd", "peak_mib"),
    }
    for clock in ("time", "cpu_time"):
        field = f"{clock}_s"
        out[f"fwd_{clock}_torch_over_matmul"] = s("torch/fwd", field) / s("matmul/fwd", field)
        out[f"fwd_{clock}_torch_over_naive"] = s("torch/fwd", field) / s("naive/fwd", field)
        out[f"fwdbwd_{clock}_torch_over_naive"] = s("torch/fwd+bwd", field) / s("naive/fwd+bwd", field)
        out[f"fwdbwd_{clock}_torch_over_matmul"] = s("torch/fwd+bwd", field) / s("matmul/fwd+bwd", field)
    return out


TARGETS = {
    "fwd_peak_torch_over_naive": 1 / 8,
    "fwdbwd_peak_torch_over_naive": 1 / 6,
    "fwd_time_torch_over_matmul": 1.3,
    "fwdbwd_time_torch_over_naive": 1.0,
    "fwd_cpu_time_torch_over_matmul": 1.3,
    "fwdbwd_cpu_time_torch_over_naive": 1.0,
}


def sweep(d, ns, vs, fixed_n, fixed_v, chunk, repeats) -> list[dict]:
    """The torch backend with a fixed chunk size over N (at ``fixed_v``) and V (at ``fixed_n``)."""
    rows = []
    shapes = [(n, fixed_v) for n in ns] + [(fixed_n, v) for v in vs if v != fixed_v]
    for n, v in shapes:
        for mode in MODES:
            rec = spawn("torch", mode, n, d, v, repeats, chunk)
            peak = statistics.median(rec["peaks_mib"])
            # Backward returns fp32 gradients of hidden and weight; what must stay flat is the rest.
            grads_mib = (n * d + v * d) * 4 / 2**20 if mode == "fwd+bwd" else 0.0
            rows.append({"N": n, "V": v, "mode": mode, "chunk_size": chunk,
                         "time_s": statistics.median(rec["times_s"]),
                         "cpu_time_s": statistics.median(rec["cpu_times_s"]),
                         "peak_mib": peak, "peak_without_grads_mib": peak - grads_mib})
            print(f"  sweep N={n:>6} V={v:>6} {mode:<7} time {rows[-1]['time_s']:7.3f} s "
                  f"cpu {rows[-1]['cpu_time_s']:7.3f} s peak {peak:8.1f} MiB "
                  f"(without the gradients it returns {peak - grads_mib:6.1f} MiB)", flush=True)
    return rows


def gpu_comparison(n, d, v, dtype_name="bfloat16", repeats=10) -> dict | None:
    """On CUDA: triton against torch backend (and naive), CUDA-event time and peak allocated memory."""
    import torch

    if not torch.cuda.is_available():
        return None
    from rltk.kernels import token_logprobs_and_entropy

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    hidden = torch.randn(n, d, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, device="cuda") * d**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    out = {}
    for impl in ("triton", "torch", "naive"):
        for mode in MODES:
            def run():
                lp, ent = token_logprobs_and_entropy(hidden, weight, labels, impl=impl)
                if mode == "fwd+bwd":
                    (lp.sum() + 0.1 * ent.sum()).backward()
            run()  # compile / warm up
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            times = []
            for _ in range(repeats):
                hidden.grad = weight.grad = None
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            out[f"{impl}/{mode}"] = {"time_s": statistics.median(times),
                                     "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20}
    out["device"] = torch.cuda.get_device_name()
    out["dtype"] = dtype_name
    return out


def print_table(summary: dict, ratio: dict) -> None:
    print(f"\n{'case':<18}{'wall (s)':>10}{'cpu (s)':>10}{'peak extra (MiB)':>18}")
    for key, val in summary.items():
        print(f"{key:<18}{val['time_s']:>10.3f}{val['cpu_time_s']:>10.3f}{val['peak_mib']:>18.1f}")
    print(f"\n{'ratio':<36}{'measured':>10}{'target':>10}  ok")
    for key, value in ratio.items():
        target = TARGETS.get(key)
        verdict = "" if target is None else ("yes" if value <= target else "NO")
        shown = "" if target is None else f"{target:.3f}"
        print(f"{key:<36}{value:>10.3f}{shown:>10}  {verdict}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shape, one round, short sweep")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the main comparison (default 3, quick 1)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs inside each child process")
    parser.add_argument("--no-sweep", action="store_true", help="skip the scaling sweep")
    parser.add_argument("--out", type=Path, help="JSON output path (default benchmarks/results/logprobs-<time>.json)")
    parser.add_argument("--child", nargs=6, metavar=("CASE", "MODE", "N", "D", "V", "REPEATS"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        case, mode, n, d, v, repeats = args.child
        print(json.dumps(run_child(case, mode, int(n), int(d), int(v), int(repeats), args.chunk)))
        return

    if args.quick:
        n, d, v = 2048, 256, 8000
        sweep_args = dict(ns=[512, 1024, 2048], vs=[4000, 8000, 16000], fixed_n=1024, fixed_v=8000, chunk=[256, 4096])
    else:
        n, d, v = 8192, 512, 32000
        sweep_args = dict(ns=[1024, 2048, 4096], vs=[8000, 16000, 32000, 64000], fixed_n=2048, fixed_v=16000,
                          chunk=[1024, 8192])
    rounds = args.rounds or (1 if args.quick else 3)
    print(f"token log-probs + entropy, N={n} D={d} V={v} fp32, {rounds} round(s) x {args.repeats} run(s) per case")
    summary = main_comparison(n, d, v, rounds, args.repeats)
    ratio = ratios(summary)
    print_table(summary, ratio)
    rows = []
    if not args.no_sweep:
        print(f"\nscaling sweep, torch backend, chunk_size={tuple(sweep_args['chunk'])}, D={d}")
        rows = sweep(d, repeats=args.repeats, **sweep_args)
    gpu = gpu_comparison(n, d, v)
    if gpu is None:
        print("\nno CUDA device: the triton-vs-torch GPU comparison (gpu_comparison) was skipped")
    report = {
        "shape": {"N": n, "D": d, "V": v, "dtype": "float32"},
        "rounds": rounds, "repeats": args.repeats,
        "summary": summary, "ratios": ratio, "targets": TARGETS, "sweep": rows, "gpu": gpu,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    out = args.out or RESULTS_DIR / f"logprobs-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
