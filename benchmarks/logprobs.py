"""Benchmark: fused token log-probs + entropy against full logits and the bare matmul.

    python benchmarks/logprobs.py            # N=8192 D=512 V=32000 fp32, 3 rounds, plus a scaling sweep
    python benchmarks/logprobs.py --quick    # a smaller shape, 1 round, short sweep
    python benchmarks/logprobs.py --device cuda --repeats 3   # GPU: N=16384 D=4096, V=151936 and 151665,
                                                              # bf16/fp32/fp16, triton vs naive vs bare matmul

Cases (each in its own subprocess, so peak memory is that case's alone):

* ``matmul``: ``hidden @ weight.T`` (forward) and its two gradient matmuls
  (forward+backward): the floor, since every method must compute these products.
* ``naive``: full fp32 logits, ``log_softmax``, gather, entropy (``impl="naive"``).
* ``torch``: the chunked torch backend (``impl="torch"``).
* ``triton``: with ``--device cuda`` (CUDA-event times, ``torch.cuda.max_memory_allocated`` peaks,
  and a correctness check of values and gradients against ``naive`` per dtype and vocabulary).

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
import math
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


# --------------------------------------------------------------------------
# CUDA: every backend, dtype and vocabulary size in one process
# --------------------------------------------------------------------------

CUDA_CASES = ("matmul", "triton", "naive", "torch")
# The CUDA path's device. "cpu" only for --interpreter-check: the same code on CPU tensors under
# TRITON_INTERPRET=1 at a small shape, to test this script's logic on a machine without a GPU
# (wall-clock times, no peak memory; its numbers mean nothing).
_DEV = "cuda"


def _reset_peak() -> int:
    """Reset the peak counter; the bytes allocated now (0 on CPU)."""
    import torch

    if _DEV != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_mib(base: int) -> float:
    import torch

    return (torch.cuda.max_memory_allocated() - base) / 2**20 if _DEV == "cuda" else float("nan")


def _empty_cache():
    import torch

    if _DEV == "cuda":
        torch.cuda.empty_cache()


class _Timer:
    """CUDA events around a region on the GPU, the wall clock after a sync elsewhere."""

    def __enter__(self):
        import torch

        if _DEV == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        if _DEV == "cuda":
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1000
        else:
            self.seconds = time.perf_counter() - self.t0
CUDA_TARGETS = {
    "fwd_time_triton_over_matmul": 1.3,
    "fwdbwd_time_triton_over_naive": 1.0,
    "fwd_peak_triton_over_naive": 1 / 8,
    "fwdbwd_peak_triton_over_naive": 1 / 6,
}
# Relative errors ||ours - naive|| / ||naive|| that pass. The naive path upcasts to fp32 like the
# kernels (which run bf16/fp16 values through TF32, exact for them, and fp32 through IEEE fp32), so
# values agree to fp32 rounding over D-long sums; gradients come back in the input dtype, so a
# half-precision gradient carries that dtype's rounding (2^-8 for bf16, 2^-11 for fp16).
CUDA_TOLERANCES = {
    "float32": {"logprobs": 1e-5, "entropy": 1e-5, "grad_hidden": 1e-4, "grad_weight": 1e-4},
    "bfloat16": {"logprobs": 1e-5, "entropy": 1e-5, "grad_hidden": 1e-2, "grad_weight": 1e-2},
    "float16": {"logprobs": 1e-5, "entropy": 1e-5, "grad_hidden": 2e-3, "grad_weight": 2e-3},
}


def _cuda_inputs(n, d, v, dtype, seed):
    """Fresh random inputs (never zeros): logits of unit scale, every 7th label ignored."""
    import torch

    gen = torch.Generator(device=_DEV).manual_seed(seed)
    hidden = torch.randn(n, d, device=_DEV, generator=gen).to(dtype)
    weight = (torch.randn(v, d, device=_DEV, generator=gen) * d**-0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device=_DEV, generator=gen)
    labels[::7] = -100
    return hidden, weight, labels


def _rel_err(ours, ref) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def cuda_correctness(n, d, v, dtype_name, seed=1) -> dict:
    """Triton against naive (fp32 logits) on one shape: outputs and the gradients of hidden and weight,
    with random upstream gradients for both outputs; every tensor checked finite."""
    import torch

    from rltk.kernels import token_logprobs_and_entropy

    dtype = getattr(torch, dtype_name)
    hidden, weight, labels = _cuda_inputs(n, d, v, dtype, seed)
    gen = torch.Generator(device=_DEV).manual_seed(seed + 1)
    up_lp = torch.randn(n, device=_DEV, generator=gen)
    up_ent = torch.randn(n, device=_DEV, generator=gen)
    results = {}
    for impl in ("triton", "naive"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = token_logprobs_and_entropy(h, w, labels, impl=impl, temperature=0.9)
        ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
        results[impl] = {"logprobs": lp.detach(), "entropy": ent.detach(), "grad_hidden": h.grad, "grad_weight": w.grad}
        del h, w, lp, ent
    ours, ref = results["triton"], results["naive"]
    out = {"N": n, "D": d, "V": v, "dtype": dtype_name, "temperature": 0.9, "errors": {}, "finite": {}, "ok": True}
    for key, tol in CUDA_TOLERANCES[dtype_name].items():
        err = _rel_err(ours[key], ref[key])
        finite = bool(torch.isfinite(ours[key]).all())
        out["errors"][key] = err
        out["finite"][key] = finite
        out["ok"] &= finite and err <= tol
    out["tolerances"] = CUDA_TOLERANCES[dtype_name]
    out["max_abs_logprob_diff"] = float((ours["logprobs"] - ref["logprobs"]).abs().max())
    out["grad_dtypes"] = [str(ours["grad_hidden"].dtype), str(ours["grad_weight"].dtype)]
    del results, ours, ref
    _empty_cache()
    return out


def cuda_case(case, mode, hidden, weight, labels, repeats) -> dict:
    """Median CUDA-event time of ``repeats`` runs after one warm-up, and the peak memory allocated above
    the inputs (outputs and, for fwd+bwd, the gradients it creates included)."""
    import torch

    from rltk.kernels import token_logprobs_and_entropy

    backward = mode == "fwd+bwd"
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    grad_logits = None
    if case == "matmul" and backward:
        # The bare product's backward needs an upstream [N, V] gradient; it exists before timing
        # starts (a real loss would make it), so it is in neither the time nor the peak.
        grad_logits = torch.ones(hidden.shape[0], weight.shape[0], device=_DEV, dtype=hidden.dtype)

    def run():
        if case == "matmul":
            logits = h @ w.T
            if backward:
                logits.backward(grad_logits)
            return logits
        lp, ent = token_logprobs_and_entropy(h, w, labels, impl=case)
        if backward:
            (lp.sum() + 0.1 * ent.sum()).backward()
        return lp

    try:
        with torch.set_grad_enabled(backward):
            out = run()  # Triton compiles here; cuBLAS picks its algorithm
            del out
            times, peaks = [], []
            for _ in range(repeats):
                h.grad = w.grad = None
                base = _reset_peak()
                with _Timer() as timer:
                    out = run()
                times.append(timer.seconds)
                peaks.append(_peak_mib(base))
                del out
    except torch.cuda.OutOfMemoryError as err:
        return {"case": case, "mode": mode, "error": f"OutOfMemoryError: {str(err).splitlines()[0]}"}
    finally:
        h.grad = w.grad = None
        del grad_logits
        _empty_cache()
    return {"case": case, "mode": mode, "time_s": statistics.median(times), "times_s": times,
            "peak_mib": max(peaks)}


def cuda_ratios(cases: dict) -> dict:
    def get(key, field):
        return cases.get(key, {}).get(field)

    def ratio(a, b):
        return None if a is None or b is None or math.isnan(a) or math.isnan(b) else a / b

    return {
        "fwd_time_triton_over_matmul": ratio(get("triton/fwd", "time_s"), get("matmul/fwd", "time_s")),
        "fwd_time_triton_over_naive": ratio(get("triton/fwd", "time_s"), get("naive/fwd", "time_s")),
        "fwdbwd_time_triton_over_naive": ratio(get("triton/fwd+bwd", "time_s"), get("naive/fwd+bwd", "time_s")),
        "fwdbwd_time_triton_over_matmul": ratio(get("triton/fwd+bwd", "time_s"), get("matmul/fwd+bwd", "time_s")),
        "fwd_peak_triton_over_naive": ratio(get("triton/fwd", "peak_mib"), get("naive/fwd", "peak_mib")),
        "fwdbwd_peak_triton_over_naive": ratio(get("triton/fwd+bwd", "peak_mib"), get("naive/fwd+bwd", "peak_mib")),
    }


def cuda_versions() -> dict:
    import subprocess as sp

    import torch
    import triton

    if _DEV != "cuda":
        return {"gpu": "none (CPU, Triton interpreter check)", "driver": "-", "torch": torch.__version__,
                "cuda": None, "triton": triton.__version__, "python": platform.python_version()}
    props = torch.cuda.get_device_properties(0)
    try:
        driver = sp.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                        capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, sp.TimeoutExpired):
        driver = "unknown (nvidia-smi did not answer)"
    return {"gpu": torch.cuda.get_device_name(0), "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "python": platform.python_version()}


def cuda_benchmark(n, d, vocabs, dtypes, repeats, cases, out_path: Path, check_n: int | None) -> dict:
    """Every (vocab, dtype): correctness of triton against naive, then each case x mode timed.

    The JSON at ``out_path`` is rewritten after every case, so a run stopped by a time limit keeps
    what it measured.
    """
    import torch

    report = {"shape": {"N": n, "D": d}, "repeats": repeats, "targets": CUDA_TARGETS, "versions": cuda_versions(),
              "tf32_matmul_allowed": torch.backends.cuda.matmul.allow_tf32, "runs": [],
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2))

    print(f"CUDA token log-probs: N={n} D={d} V={vocabs} dtypes={dtypes} cases={cases}, "
          f"{repeats} timed runs per case after one warm-up; {report['versions']}", flush=True)
    for v in vocabs:
        for dtype_name in dtypes:
            run = {"V": v, "dtype": dtype_name, "cases": {}}
            report["runs"].append(run)
            start = time.perf_counter()
            try:
                run["correctness"] = cuda_correctness(check_n or n, d, v, dtype_name)
            except torch.cuda.OutOfMemoryError as err:
                run["correctness"] = {"ok": False, "error": f"OutOfMemoryError: {str(err).splitlines()[0]}"}
            _empty_cache()
            c = run["correctness"]
            print(f"V={v} {dtype_name}: correctness {'ok' if c['ok'] else 'FAILED'} "
                  f"{ {k: f'{e:.2e}' for k, e in c.get('errors', {}).items()} or c.get('error')} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
            save()
            hidden, weight, labels = _cuda_inputs(n, d, v, getattr(torch, dtype_name), seed=0)
            for mode in MODES:
                for case in cases:
                    start = time.perf_counter()
                    rec = cuda_case(case, mode, hidden, weight, labels, repeats)
                    run["cases"][f"{case}/{mode}"] = rec
                    shown = rec.get("error") or f"{rec['time_s'] * 1e3:9.2f} ms  peak {rec['peak_mib']:9.1f} MiB"
                    print(f"  V={v} {dtype_name:<8} {case:>6} {mode:<7} {shown} "
                          f"({time.perf_counter() - start:.1f} s)", flush=True)
                    save()
            run["ratios"] = cuda_ratios(run["cases"])
            del hidden, weight, labels
            _empty_cache()
            save()
    return report


# Block configurations for --triton-configs: the default first, then larger token / vocab tiles, more
# warps and deeper pipelines (data for tuning TritonConfig on a GPU; each compiles once, a few seconds).
TRITON_SWEEP = (
    dict(block_n=64, block_v=128, block_d=64, num_warps=8, num_stages=2),
    dict(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=2),
    dict(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3),
    dict(block_n=64, block_v=256, block_d=64, num_warps=8, num_stages=2),
    dict(block_n=128, block_v=256, block_d=32, num_warps=8, num_stages=3),
    dict(block_n=64, block_v=128, block_d=64, num_warps=4, num_stages=3),
)


def cuda_config_sweep(n, d, v, dtype_name, repeats, out_path: Path) -> dict:
    """Forward and forward+backward time and peak of each TRITON_SWEEP config (one shape, one dtype)."""
    import torch

    from rltk.kernels.logprobs import triton_token_logprobs_and_entropy
    from rltk.kernels.triton_logprobs import TritonConfig

    hidden, weight, labels = _cuda_inputs(n, d, v, getattr(torch, dtype_name), seed=0)
    report = {"shape": {"N": n, "D": d, "V": v}, "dtype": dtype_name, "repeats": repeats,
              "versions": cuda_versions(), "configs": []}
    for params in TRITON_SWEEP:
        config = TritonConfig(**params)
        row = {"config": params}
        report["configs"].append(row)
        for mode in MODES:
            backward = mode == "fwd+bwd"
            h, w = hidden.detach().requires_grad_(backward), weight.detach().requires_grad_(backward)
            try:
                with torch.set_grad_enabled(backward):
                    times, peaks = [], []
                    for i in range(repeats + 1):  # the first compiles
                        h.grad = w.grad = None
                        base = _reset_peak()
                        with _Timer() as timer:
                            lp, ent = triton_token_logprobs_and_entropy(h, w, labels, config=config)
                            if backward:
                                (lp.sum() + 0.1 * ent.sum()).backward()
                        if i:
                            times.append(timer.seconds)
                            peaks.append(_peak_mib(base))
                        del lp, ent
                row[mode] = {"time_s": statistics.median(times), "times_s": times, "peak_mib": max(peaks)}
            except Exception as err:  # a config the compiler rejects (shared memory) is data, not a crash
                row[mode] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            finally:
                h.grad = w.grad = None
                _empty_cache()
            shown = row[mode].get("error") or f"{row[mode]['time_s'] * 1e3:9.2f} ms"
            print(f"  {params} {mode:<7} {shown}", flush=True)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(report, indent=2))
    return report


def sweep_table(report: dict) -> str:
    lines = [f"Triton configs, {report['dtype']}, N={report['shape']['N']} D={report['shape']['D']} "
             f"V={report['shape']['V']}, median of {report['repeats']}", "",
             "| block_n | block_v | block_d | warps | stages | fwd (ms) | fwd+bwd (ms) |", "|---|---|---|---|---|---|---|"]
    for row in report["configs"]:
        c = row["config"]
        cells = [("error" if "error" in row.get(m, {}) else f"{row[m]['time_s'] * 1e3:.2f}") if m in row else "-"
                 for m in MODES]
        lines.append(f"| {c['block_n']} | {c['block_v']} | {c['block_d']} | {c['num_warps']} | {c['num_stages']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def cuda_table(report: dict) -> str:
    """Markdown tables: times and peaks per case, then the ratios against their targets."""
    v0 = report["versions"]
    lines = [f"GPU {v0['gpu']}, driver {v0['driver']}, torch {v0['torch']} (CUDA {v0['cuda']}), "
             f"Triton {v0['triton']}; N={report['shape']['N']} D={report['shape']['D']}, "
             f"median of {report['repeats']} runs after a warm-up", "",
             "| V | dtype | case | fwd (ms) | fwd peak (MiB) | fwd+bwd (ms) | fwd+bwd peak (MiB) |",
             "|---|---|---|---|---|---|---|"]

    def cell(rec, field, scale, fmt):
        if rec is None:
            return "-"
        if "error" in rec:
            return "OOM" if "OutOfMemory" in rec["error"] else "error"
        return fmt.format(rec[field] * scale)

    for run in report["runs"]:
        names = sorted({k.split("/")[0] for k in run["cases"]}, key=CUDA_CASES.index)
        for case in names:
            f, b = run["cases"].get(f"{case}/fwd"), run["cases"].get(f"{case}/fwd+bwd")
            lines.append(f"| {run['V']} | {run['dtype']} | {case} | {cell(f, 'time_s', 1e3, '{:.2f}')} | "
                         f"{cell(f, 'peak_mib', 1, '{:.0f}')} | {cell(b, 'time_s', 1e3, '{:.2f}')} | "
                         f"{cell(b, 'peak_mib', 1, '{:.0f}')} |")
    lines += ["", "| V | dtype | correct (rel. err. lp / ent / dh / dW) | " + " | ".join(CUDA_TARGETS) + " |",
              "|---|---|---|" + "---|" * len(CUDA_TARGETS)]
    for run in report["runs"]:
        c = run.get("correctness", {})
        errs = c.get("errors")
        shown = ("yes " if c.get("ok") else "NO ") + (
            " / ".join(f"{errs[k]:.1e}" for k in ("logprobs", "entropy", "grad_hidden", "grad_weight"))
            if errs else str(c.get("error")))
        ratios = run.get("ratios", {})
        cells = []
        for key, target in CUDA_TARGETS.items():
            value = ratios.get(key)
            cells.append("-" if value is None else f"{value:.3f} ({'ok' if value <= target else 'MISSED'})")
        lines.append(f"| {run['V']} | {run['dtype']} | {shown} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("targets: " + ", ".join(f"{k} <= {t:.3f}" for k, t in CUDA_TARGETS.items()))
    return "\n".join(lines)


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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: triton, naive, torch and the bare matmul on the GPU, one process (see --vocab)")
    parser.add_argument("--n", type=int, default=16384, help="cuda: tokens (rows of hidden)")
    parser.add_argument("--d", type=int, default=4096, help="cuda: hidden size")
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 151665],
                        help="cuda: vocabulary sizes (default Qwen2.5's padded head and its tokenizer's odd size)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32", "float16"],
                        choices=("float32", "bfloat16", "float16"), help="cuda: input dtypes")
    parser.add_argument("--cases", nargs="+", default=["matmul", "triton", "naive"], choices=CUDA_CASES,
                        help="cuda: backends to time (torch: the chunked CPU backend, run on the GPU)")
    parser.add_argument("--check-n", type=int, help="cuda: rows of the correctness check (default --n)")
    parser.add_argument("--table", type=Path, help="cuda: also write the markdown table here")
    parser.add_argument("--triton-configs", action="store_true",
                        help="with --device cuda: time the TRITON_SWEEP block configs at the first --vocab/--dtypes")
    parser.add_argument("--interpreter-check", action="store_true",
                        help="with --device cuda: run that path on CPU tensors under TRITON_INTERPRET=1 (logic only)")
    parser.add_argument("--child", nargs=6, metavar=("CASE", "MODE", "N", "D", "V", "REPEATS"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        case, mode, n, d, v, repeats = args.child
        print(json.dumps(run_child(case, mode, int(n), int(d), int(v), int(repeats), args.chunk)))
        return

    if args.device == "cuda":
        import torch

        global _DEV
        if args.interpreter_check:
            if os.environ.get("TRITON_INTERPRET") != "1":
                parser.error("--interpreter-check needs TRITON_INTERPRET=1 in the environment")
            _DEV = "cpu"
        elif not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
        out = args.out or RESULTS_DIR / f"logprobs-cuda-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        if args.triton_configs:
            report = cuda_config_sweep(args.n, args.d, args.vocab[0], args.dtypes[0], max(1, args.repeats), out)
            table = sweep_table(report)
            print("\n" + table)
            if args.table:
                args.table.parent.mkdir(parents=True, exist_ok=True)
                args.table.write_text(table + "\n")
            return
        report = cuda_benchmark(args.n, args.d, args.vocab, args.dtypes, max(1, args.repeats), args.cases, out,
                                args.check_n)
        table = cuda_table(report)
        print("\n" + table)
        if args.table:
            args.table.parent.mkdir(parents=True, exist_ok=True)
            args.table.write_text(table + "\n")
        print(f"\nwrote {out}")
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
    report = {
        "shape": {"N": n, "D": d, "V": v, "dtype": "float32"},
        "rounds": rounds, "repeats": args.repeats,
        "summary": summary, "ratios": ratio, "targets": TARGETS, "sweep": rows,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    out = args.out or RESULTS_DIR / f"logprobs-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
