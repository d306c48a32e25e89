"""Benchmark: one GRPO loss from hidden states and the LM head, rltk's fused op against naive torch and the peers.

    python benchmarks/grpo_head_loss.py                        # CUDA, bf16, the issue-47 shapes (0.5B and 7B heads)
    python benchmarks/grpo_head_loss.py --device cpu --tiny    # small shapes, fp32, seconds (what the test runs)
    TRITON_INTERPRET=1 python benchmarks/grpo_head_loss.py --device cpu --tiny --methods rltk-triton cce liger-flce
                                                               # the Triton rows in the CPU interpreter: errors only

Every method computes the same loss from the same inputs (issue 47, item 3)::

    logp_i  = log softmax(h_i W^T)[y_i]                     (per token; hidden h [N, H], head W [V, H])
    r_i     = exp(logp_i - old_i)                           (old log-probs: fixed inputs)
    loss    = sum_i m_i * -min(r_i A_b(i), clip(r_i, 1 - 0.2, 1 + 0.2) A_b(i)) / sum_i m_i

with ``N = B x T`` tokens in ``B`` sequences, one advantage ``A_b`` per sequence, and a response mask ``m``
(each sequence ends at a random length; the tail is padding, label -100 where a method takes an ignore index).
Forward and backward to ``h`` and ``W``; time is the median of ``--repeats`` runs after ``--warmup`` runs (CUDA:
after a device sync; CPU: wall clock). Peak memory is what one run adds above the inputs, gradients included:
CUDA ``torch.cuda.max_memory_allocated`` after a reset; CPU the resident set's high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs``) with ``MALLOC_MMAP_THRESHOLD_=1048576`` so freed buffers return to the OS
(the script re-runs itself with it set), best effort: at the tiny shapes it is mostly allocator noise.
Errors are ``||d - d_ref|| / ||d_ref||`` for the gradients of ``h`` and ``W`` against a float64 reference
(chunked over tokens, full logits per chunk, rounded to fp32 at the end), and the loss's absolute difference.
The rate is ``8 N H V / time`` (forward, the backward's recomputation and the two gradient products).

Methods (``--methods``; a method that cannot run here is a row that says why, never a crash):

* ``rltk-torch``, ``rltk-triton``, ``rltk-triton-hopper``: ``rltk.kernels.token_logprobs_and_entropy`` with that
  backend (the Triton ones: CUDA, or the interpreter under ``TRITON_INTERPRET=1``); entropy comes out too,
  unused. ``rltk-triton-hopper-det``: the Hopper kernels under ``torch.use_deterministic_algorithms(True)`` (their
  two-kernel backward without atomics). The Hopper rows autotune on their first (warm-up) call.
* ``verl``: verl's fused Triton kernel (``verl.utils.kernel.linear_cross_entropy``), where verl imports.
* ``naive``: logits in the input dtype (bf16 on the GPU), fp32 ``log_softmax``, gather: what a plain model does.
* ``naive-fp32``: rltk's ``impl="naive"`` (inputs upcast to fp32 before the matmul).
* ``cce``, ``cce-exact``: Cut Cross-Entropy's ``linear_cross_entropy(..., reduction="none")`` (Triton), with its
  default gradient filtering (``filter_eps="high"``) and without (``filter_eps=None``).
* ``cce-torch_compile``: the same call with ``impl="torch_compile"`` (full logits under ``torch.compile``: CCE's
  only path off the GPU; the logits are materialised, so it is not the CCE algorithm).
* ``liger-grpo``: Liger-Kernel's chunked ``LigerFusedLinearGRPOLoss`` (``loss_type="dapo"``: token-mean; no KL;
  torch, so it runs on a CPU; ``torch.compile`` of its loss math on CUDA only, since inductor's C++ build takes
  minutes on a busy CPU).
* ``liger-flce``: Liger's fused linear cross-entropy (Triton), ``reduction="none"``, per-token upstream gradients.

Results: a markdown table per shape on stdout (``--table`` also writes it) and JSON (``--out``, default
``benchmarks/results/grpo_head_loss-<time>.json``), rewritten after every method.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torch  # noqa: E402
from process_memory import memory_kib, reset_peak  # noqa: E402

RESULTS_DIR = HERE / "results"
# (B sequences, T tokens, H, V): N = B * T. The GPU shapes are issue 47's: the heads of Qwen2.5-0.5B and -7B.
GPU_SHAPES = ((64, 512, 896, 151936), (32, 512, 3584, 152064))
# Small enough for seconds on a CPU; the second crosses the torch backend's 32768-wide vocabulary tile.
TINY_SHAPES = ((8, 64, 64, 2048), (4, 64, 96, 33000))
METHODS = ("rltk-torch", "rltk-triton", "rltk-triton-hopper", "rltk-triton-hopper-det", "naive", "naive-fp32",
           "verl", "cce", "cce-exact", "cce-torch_compile", "liger-grpo", "liger-flce")
RLTK_METHODS = ("rltk-torch", "rltk-triton", "rltk-triton-hopper", "rltk-triton-hopper-det")
# Issue 59's table: one row per shape, these methods as columns (the two Hopper ones are the new kernels).
ISSUE_COLUMNS = (("naive", "naive torch"), ("rltk-triton", "rltk `impl=triton`"),
                 ("rltk-triton-hopper", "rltk `impl=triton-hopper`"),
                 ("rltk-triton-hopper-det", "rltk `triton-hopper`, deterministic"), ("verl", "verl kernel"),
                 ("cce", "Cut Cross-Entropy"), ("liger-grpo", "Liger (chunked GRPO loss)"))
CLIP = 0.2
IGNORE = -100
# What rltk's rows must meet against the float64 reference (the test asserts it on the tiny CPU shapes):
# fp32 inputs give fp32 rounding over H- and N-long sums; half precision gives the gradient's own dtype
# rounding (issue 47's bar for bf16 is 2e-3, today's measured 1.5e-3).
TOLERANCES = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 4e-3}
# Issue 47's bar for rltk's GPU kernel (item 1), checked on the rows that ran: rate, peak against naive's, errors.
TARGETS = {"tflops": 600.0, "peak_over_naive": 0.02, "error": 2e-3}


# --------------------------------------------------------------------------
# The loss every method shares, its inputs, and the float64 reference
# --------------------------------------------------------------------------


def grpo_token_mean(logp, old, adv_tok, mask):
    """Clipped-ratio policy loss, token mean over the mask. All shapes: (N,); returns a scalar (fp32 or fp64)."""
    ratio = (logp - old).exp()
    pg = -torch.minimum(ratio * adv_tok, ratio.clamp(1 - CLIP, 1 + CLIP) * adv_tok)
    return (pg * mask).sum() / mask.sum()


def make_inputs(b, t, h, v, dtype, device, seed=0) -> dict:
    """Random inputs (never zeros): logits of a few units, per-sequence advantages, response masks."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = b * t
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (2.0 / math.sqrt(h))
    labels = torch.randint(0, v, (n,), generator=gen)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float().reshape(n)  # [B*T]
    adv = torch.randn(b, generator=gen)
    return {"hidden": hidden.to(device, dtype), "weight": weight.to(device, dtype),
            "labels": labels.masked_fill(mask == 0, IGNORE).to(device), "mask": mask.to(device),
            "adv": adv.to(device), "adv_tok": adv.repeat_interleave(t).to(device), "B": b, "T": t,
            "noise": (0.3 * torch.randn(n, generator=gen)).to(device)}


def reference(inp: dict, chunk: int) -> dict:
    """float64 log-probs, the old log-probs (reference + noise, so some ratios clip), the loss and its gradients
    of hidden and weight, chunked over tokens so the full fp64 logits never exist at once."""
    hidden, weight, labels, mask = inp["hidden"], inp["weight"], inp["labels"], inp["mask"]
    n, v = hidden.shape[0], weight.shape[0]
    w64 = weight.double()
    safe = labels.clamp(min=0)
    logp = torch.empty(n, dtype=torch.float64, device=hidden.device)
    for s in range(0, n, chunk):
        logits = hidden[s:s + chunk].double() @ w64.T  # [c, V]
        logp[s:s + chunk] = logits.gather(1, safe[s:s + chunk, None]).squeeze(1) - logits.logsumexp(1)
    logp = logp.masked_fill(labels == IGNORE, 0.0)
    old = (logp + inp["noise"].double()).float()  # what a rollout would have recorded, in fp32
    leaf = logp.clone().requires_grad_()
    loss = grpo_token_mean(leaf, old.double(), inp["adv_tok"].double(), mask.double())
    (g,) = torch.autograd.grad(loss, leaf)  # dloss/dlogp: [N], zero where masked or clipped
    d_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    d_weight = torch.zeros(v, hidden.shape[1], dtype=torch.float64, device=hidden.device)
    for s in range(0, n, chunk):
        h64 = hidden[s:s + chunk].double()
        logits = h64 @ w64.T
        dz = -(logits - logits.logsumexp(1, keepdim=True)).exp_() * g[s:s + chunk, None]  # -g p
        dz.scatter_add_(1, safe[s:s + chunk, None], g[s:s + chunk, None])  # + g onehot (g = 0 where ignored)
        d_hidden[s:s + chunk] = (dz @ w64).float()
        d_weight.addmm_(dz.T, h64)
        del logits, dz
    return {"old": old, "loss": float(loss.detach()), "d_hidden": d_hidden, "d_weight": d_weight.float()}


# --------------------------------------------------------------------------
# The methods: each returns the loss (a scalar to call .backward() on) from the same inputs
# --------------------------------------------------------------------------


def unavailable(method: str, device: str) -> str | None:
    """Why ``method`` cannot run here, or None."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    triton_ok = device == "cuda" or interpreted
    no_triton = ("its kernels are Triton: they need a CUDA device (or TRITON_INTERPRET=1 for the CPU "
                 "interpreter, errors only)")
    if method.startswith("rltk-triton") and not triton_ok:
        return no_triton + "; rltk-torch is the CPU backend"
    if method == "verl":
        try:
            verl_linear_cross_entropy()
        except Exception as err:  # noqa: BLE001 - any failure to import a peer means no row, with the reason
            return f"verl's kernel does not import ({type(err).__name__}: {str(err)[:200]}); pip install --no-deps verl==0.9.1"
        if not triton_ok:
            return no_triton
    if method.startswith("cce"):
        try:
            import cut_cross_entropy  # noqa: F401
        except ImportError as err:
            return f"not installed ({err}); pip install --no-deps cut-cross-entropy==25.1.1"
        if method != "cce-torch_compile" and not triton_ok:
            return no_triton + "; the cce-torch_compile row is its CPU path"
    if method.startswith("liger"):
        try:
            import liger_kernel  # noqa: F401
        except ImportError as err:
            return f"not installed ({err}); pip install --no-deps liger-kernel==0.8.5"
        if method == "liger-flce" and not triton_ok:
            return no_triton + "; the liger-grpo row (torch) runs on a CPU"
    return None


def verl_linear_cross_entropy():
    """verl's fused ``linear_cross_entropy`` (``verl.utils.kernel``), imported without verl's package ``__init__``.

    That ``__init__`` (and ``verl.utils``'s) imports Ray, tensordict, omegaconf and more; the kernel itself needs
    torch, Triton and ``verl.utils.device``. So the three package levels above the kernel are registered as bare
    namespace modules on verl's own files, which ``import verl`` would not be, and a plain import is tried first.
    """
    import importlib
    import importlib.util
    import types

    try:
        return importlib.import_module("verl.utils.kernel.linear_cross_entropy").linear_cross_entropy
    except ImportError:
        pass
    for name in ("verl", "verl.utils", "verl.utils.kernel"):  # a failed import leaves none of them behind
        sys.modules.pop(name, None)
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'verl'")
    root = Path(spec.submodule_search_locations[0])
    for name in ("verl", "verl.utils", "verl.utils.kernel"):
        module = types.ModuleType(name)
        module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = module
    return importlib.import_module("verl.utils.kernel.linear_cross_entropy").linear_cross_entropy


def loss_fn(method: str, inp: dict, old, device: str):
    """A function of (hidden, weight) giving ``method``'s loss on ``inp``."""
    labels, mask, adv_tok = inp["labels"], inp["mask"], inp["adv_tok"]

    def from_logp(logp):
        return grpo_token_mean(logp, old, adv_tok, mask)

    if method in RLTK_METHODS:
        from rltk.kernels import token_logprobs_and_entropy

        impl = method.removeprefix("rltk-").removesuffix("-det")
        deterministic = method.endswith("-det")

        def rltk_loss(h, w):
            # the op reads torch's determinism flag when it runs forward; its backward keeps that mode
            before = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(deterministic, warn_only=True)
            try:
                return from_logp(token_logprobs_and_entropy(h, w, labels, impl=impl)[0])
            finally:
                torch.use_deterministic_algorithms(before)

        return rltk_loss
    if method == "verl":
        linear_cross_entropy = verl_linear_cross_entropy()
        safe = labels.clamp(min=0)  # the mask removes padding; verl takes no ignore index
        # (hidden, weight, labels, temperature, reduction, process group) -> per-token (log-probs, entropy)
        return lambda h, w: from_logp(linear_cross_entropy(h, w, safe, 1.0, "none", None)[0].float())
    if method == "naive-fp32":
        from rltk.kernels import naive_token_logprobs_and_entropy

        return lambda h, w: from_logp(naive_token_logprobs_and_entropy(h, w, labels)[0])
    if method == "naive":
        safe = labels.clamp(min=0)

        def naive(h, w):
            logp = torch.log_softmax((h @ w.T).float(), dim=-1)  # [N, V] in the input dtype, then [N, V] fp32
            return from_logp(logp.gather(1, safe[:, None]).squeeze(1).masked_fill(labels == IGNORE, 0.0))

        return naive
    if method.startswith("cce"):
        from cut_cross_entropy import linear_cross_entropy

        kwargs = {"cce": {}, "cce-exact": {"filter_eps": None}, "cce-torch_compile": {"impl": "torch_compile"}}[method]
        # reduction="none": the per-token loss -logp (0 at ignored labels), any upstream gradient
        return lambda h, w: from_logp(-linear_cross_entropy(h, w, labels, reduction="none", **kwargs).float())
    if method == "liger-flce":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda h, w: from_logp(-liger_fused_linear_cross_entropy(h, w, labels, reduction="none").float())
    if method == "liger-grpo":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        b, t = inp["B"], inp["T"]
        # dapo: sum over masked tokens / their count (token-mean); beta 0: no KL, no reference model
        module = LigerFusedLinearGRPOLoss(beta=0.0, compiled=device == "cuda", use_ref_model=False,
                                          epsilon_low=CLIP, epsilon_high=CLIP, loss_type="dapo")
        ids = labels.clamp(min=0).view(b, t)  # padding needs a valid id here; the mask removes it
        m, a, o = mask.view(b, t), inp["adv"], old.view(b, t)
        return lambda h, w: module(h.view(b, t, -1), w, ids, m, a, old_per_token_logps=o)[0]
    raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")


# --------------------------------------------------------------------------
# Timing, memory, errors
# --------------------------------------------------------------------------


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def peak_start(device) -> int:
    """Reset the peak counter; what is held now (bytes on CUDA, KiB resident on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    reset_peak()
    return memory_kib()["VmRSS"]


def peak_mib(device, base) -> float:
    if device == "cuda":
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    return (memory_kib()["VmHWM"] - base) / 1024


def rel_err(ours, ref) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-300))


def run_method(method, inp, ref, device, warmup, repeats) -> dict:
    """Time and peak of forward + backward; the first run's gradients against the reference."""
    reason = unavailable(method, device)
    if reason:
        return {"status": "skipped", "reason": reason}
    h = inp["hidden"].detach().requires_grad_()
    w = inp["weight"].detach().requires_grad_()
    try:
        fn = loss_fn(method, inp, ref["old"], device)
        times, peaks, loss = [], [], None
        for i in range(warmup + repeats):
            h.grad = w.grad = None
            base = peak_start(device)
            start = time.perf_counter()
            out = fn(h, w)
            out.backward()
            sync(device)
            elapsed = time.perf_counter() - start
            if i == 0:  # compare the first result, so a later run cannot hide a wrong first one
                loss = float(out)
                errors = {"d_hidden": rel_err(h.grad, ref["d_hidden"]), "d_weight": rel_err(w.grad, ref["d_weight"]),
                          "loss_abs": abs(loss - ref["loss"])}
                finite = bool(torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all())
            if i >= warmup:
                times.append(elapsed)
                peaks.append(peak_mib(device, base))
            del out
    except Exception as err:  # a peer that fails here (compile error, OOM) is a result, not a crash
        return {"status": "error", "reason": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}",
                "traceback": traceback.format_exc()[-2000:]}
    finally:
        h.grad = w.grad = None
        if device == "cuda":
            torch.cuda.empty_cache()
    n, hh, v = inp["hidden"].shape[0], inp["hidden"].shape[1], inp["weight"].shape[0]
    median = statistics.median(times)
    result = {"status": "ok", "time_ms": median * 1e3, "times_ms": [t * 1e3 for t in times],
              "tflops": 8 * n * hh * v / median / 1e12, "peak_mib": max(peaks), "loss": loss, "finite": finite,
              "errors": errors}
    if method.startswith("rltk-triton-hopper"):  # what the autotune chose so far, for tuning the candidates
        from rltk.kernels import triton_hopper

        result["tuned_configs"] = {repr(key): repr(config) for key, config in triton_hopper.tuned_configs().items()}
    return result


def versions(device) -> dict:
    import importlib.metadata as md

    out = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    for dist in ("triton", "cut-cross-entropy", "liger-kernel", "transformers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda"] = torch.version.cuda
    return out


def acceptance(shape: dict) -> list[str]:
    """Issue 47's targets for each rltk row that ran (the GPU's are the ones that count), as lines of text."""
    naive = shape["methods"].get("naive", {})
    lines = []
    for method in RLTK_METHODS:
        r = shape["methods"].get(method, {})
        if r.get("status") != "ok":
            continue
        err = max(r["errors"]["d_hidden"], r["errors"]["d_weight"])
        parts = [f"{r['tflops']:.1f} TFLOPS ({'ok' if r['tflops'] >= TARGETS['tflops'] else 'MISSED'}: "
                 f">= {TARGETS['tflops']:.0f})",
                 f"max gradient error {err:.1e} ({'ok' if err <= TARGETS['error'] else 'MISSED'}: <= {TARGETS['error']})"]
        if naive.get("status") == "ok" and naive["peak_mib"] > 0:
            ratio = r["peak_mib"] / naive["peak_mib"]
            parts.insert(1, f"peak / naive {ratio:.4f} ({'ok' if ratio <= TARGETS['peak_over_naive'] else 'MISSED'}: "
                            f"<= {TARGETS['peak_over_naive']})")
        if naive.get("status") == "ok":
            parts.append(f"time / naive {r['time_ms'] / naive['time_ms']:.2f}")
        lines.append(f"issue 47 targets, {method}: " + "; ".join(parts))
    return lines


def issue_table(report: dict) -> str:
    """Issue 59's table: one row per shape, a cell per method of :data:`ISSUE_COLUMNS` ("ms (~TFLOPS), peak GB")."""
    lines = ["| N x H x V | " + " | ".join(title for _, title in ISSUE_COLUMNS) + " |",
             "|---|" + "---|" * len(ISSUE_COLUMNS)]
    for shape in report["shapes"]:
        cells = []
        for method, _ in ISSUE_COLUMNS:
            r = shape["methods"].get(method)
            if r is None:
                cells.append("not run")
            elif r["status"] != "ok":
                cells.append(r["status"])
            else:
                cells.append(f"{r['time_ms']:.0f} ms (~{r['tflops']:.0f} TFLOPS), {r['peak_mib'] / 1024:.2f} GB, "
                             f"dh err {r['errors']['d_hidden']:.1e}")
        lines.append(f"| {shape['N']} x {shape['H']} x {shape['V']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(report: dict) -> str:
    lines = [f"GRPO loss from hidden states and the LM head, forward + backward, {report['dtype']}, "
             f"{report['device']}; median of {report['repeats']} after {report['warmup']} warm-up(s); "
             f"peak above the inputs ({report['memory_method']}); errors vs float64; {report['versions']}"]
    for shape in report["shapes"]:
        lines += ["", f"N x H x V = {shape['N']} x {shape['H']} x {shape['V']} ({shape['B']} sequences x "
                  f"{shape['T']} tokens, {shape['masked_tokens']} in the mask); reference loss {shape['ref_loss']:.6f}",
                  "", "| method | ms | TFLOPS (8NHV/t) | peak MiB | d-hidden rel. err | d-weight rel. err | "
                  "loss abs. err | status |", "|---|---|---|---|---|---|---|---|"]
        for method, r in shape["methods"].items():
            if r["status"] != "ok":
                lines.append(f"| {method} | | | | | | | {r['status']}: {r['reason']} |")
                continue
            e = r["errors"]
            lines.append(f"| {method} | {r['time_ms']:.2f} | {r['tflops']:.3g} | {r['peak_mib']:.1f} | "
                         f"{e['d_hidden']:.2e} | {e['d_weight']:.2e} | {e['loss_abs']:.1e} | "
                         f"{'ok' if r['finite'] else 'NON-FINITE'} |")
        lines += [""] + acceptance(shape)
    lines += ["", "Issue 59's layout (peak in GiB above the inputs; d-hidden relative error vs float64):", "",
              issue_table(report)]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help=f"small shapes {TINY_SHAPES} (B, T, H, V)")
    parser.add_argument("--shapes", nargs="+", metavar="BxTxHxV", help="shapes, e.g. 64x512x896x151936")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="input dtype (default bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--warmup", type=int, help="untimed runs first (default 2; tiny 1)")
    parser.add_argument("--repeats", type=int, help="timed runs, median reported (default 5; tiny 3)")
    parser.add_argument("--ref-chunk", type=int, default=2048, help="tokens per chunk of the float64 reference")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/grpo_head_loss-<time>.json)")
    parser.add_argument("--table", type=Path, help="also write the markdown table here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu --tiny)")
    if args.shapes:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
        if any(len(s) != 4 for s in shapes):
            parser.error(f"--shapes takes BxTxHxV (4 numbers), got {args.shapes}")
    else:
        shapes = TINY_SHAPES if args.tiny else GPU_SHAPES
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if interpreted and dtype_name == "bfloat16":
        parser.error("under TRITON_INTERPRET=1, bf16 tl.dot gives garbage: pass --dtype float32 or float16")
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    repeats = args.repeats if args.repeats is not None else (3 if args.tiny else 5)
    out = args.out or RESULTS_DIR / f"grpo_head_loss-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    memory_method = ("torch.cuda.max_memory_allocated - allocated before" if args.device == "cuda" else
                     "VmHWM - VmRSS, MALLOC_MMAP_THRESHOLD_=" + os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset"))
    report = {"device": args.device, "dtype": dtype_name, "warmup": warmup, "repeats": repeats,
              "memory_method": memory_method, "tolerances": TOLERANCES, "versions": versions(args.device),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "shapes": []}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))

    for b, t, h, v in shapes:
        inp = make_inputs(b, t, h, v, getattr(torch, dtype_name), args.device)
        start = time.perf_counter()
        ref = reference(inp, args.ref_chunk)
        shape = {"B": b, "T": t, "N": b * t, "H": h, "V": v, "masked_tokens": int(inp["mask"].sum()),
                 "ref_loss": ref["loss"], "ref_seconds": time.perf_counter() - start, "methods": {}}
        report["shapes"].append(shape)
        print(f"N={b * t} H={h} V={v} {dtype_name}: float64 reference in {shape['ref_seconds']:.1f} s, "
              f"loss {ref['loss']:.6f}", flush=True)
        for method in args.methods:
            r = run_method(method, inp, ref, args.device, warmup, repeats)
            shape["methods"][method] = r
            shown = (f"{r['time_ms']:9.2f} ms {r['tflops']:8.3g} TFLOPS peak {r['peak_mib']:9.1f} MiB "
                     f"dh {r['errors']['d_hidden']:.2e} dW {r['errors']['d_weight']:.2e}"
                     if r["status"] == "ok" else f"{r['status']}: {r['reason']}")
            print(f"  {method:<18} {shown}", flush=True)
            save()
        del inp, ref
        if args.device == "cuda":
            torch.cuda.empty_cache()
    text = table(report)
    print("\n" + text)
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(text + "\n")
    save()
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    # CPU peaks read the resident set, which glibc keeps high after a free unless large blocks are mmapped
    # (FACTS.md): re-run with the threshold set, once.
    on_cpu = "--device=cpu" in sys.argv or any(a == "--device" and b == "cpu" for a, b in zip(sys.argv, sys.argv[1:]))
    if on_cpu and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"})
    main()
