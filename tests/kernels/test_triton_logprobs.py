"""The Triton backend: kernels under the CPU interpreter (in a subprocess), host helpers, GPU runs.

The kernel cases live in triton_interpreter_cases.py. They must run in a fresh
process with TRITON_INTERPRET=1 set before triton is imported; this pytest
process has usually imported triton (and decorated the kernels) long before.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from rltk.kernels import token_logprobs_and_entropy  # noqa: E402
from rltk.kernels import triton_logprobs as tl_mod  # noqa: E402

from tests.waits import scaled

CASES = Path(__file__).with_name("triton_interpreter_cases.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
EXPECTED_CASES = 20


@pytest.mark.skipif(tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9),
                    reason="Triton < 3.9's interpreter calls int() on a one-element array for a tl.minimum loop "
                           "bound, which numpy 2 refuses (seen with 3.6 on the lent GPU machine); the kernels "
                           "themselves run there, see the gpu tests")
def test_kernels_under_the_triton_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(600),
    )
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, f"interpreter cases failed:\n{report}"
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) == EXPECTED_CASES, f"expected {EXPECTED_CASES} passed cases:\n{report}"
    assert "skipped" not in result.stdout.splitlines()[-1], report


def test_merge_of_split_statistics_equals_one_pass():
    # Split a row of logits in three, summarise each part as the forward kernel
    # does (m, s = sum e^(z-m), w = sum e^(z-m)(z-m), label logit), then merge.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=gen, dtype=torch.float64) * 5
    labels = torch.tensor([3, 17, 29, 0])
    parts = []
    for cols in (slice(0, 10), slice(10, 25), slice(25, 30)):
        z = logits[:, cols]
        m = z.amax(1)
        e = (z - m[:, None]).exp()
        in_part = (labels >= cols.start) & (labels < cols.stop)
        label = torch.where(in_part, logits.gather(1, labels[:, None]).squeeze(1), 0.0)
        parts.append((m, e.sum(1), (e * (z - m[:, None])).sum(1), label))
    stacked = [torch.stack(x) for x in zip(*parts)]  # 4 tensors [3, N]
    lse, expected, entropy, label_logit = tl_mod._merge_partials(*stacked)
    p = logits.softmax(-1)
    torch.testing.assert_close(lse, logits.logsumexp(-1))
    torch.testing.assert_close(expected, (p * logits).sum(-1))
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))
    torch.testing.assert_close(label_logit, logits.gather(1, labels[:, None]).squeeze(1))
    # q = sum e^(2(z-m)) per part, as the kernel sums it when asked for sum_v p_v^2
    squares = torch.stack([(2 * (logits[:, c] - logits[:, c].amax(1, keepdim=True))).exp().sum(1)
                           for c in (slice(0, 10), slice(10, 25), slice(25, 30))])
    torch.testing.assert_close(tl_mod._merge_sum_pi_squared(stacked[0], stacked[1], squares), p.square().sum(-1))


@pytest.mark.parametrize(
    "vocab,block_v,wanted,expected",
    [
        (100, 16, 1, (1, 7)),   # 7 tiles, one split
        (100, 16, 4, (4, 2)),   # 7 tiles: 2 + 2 + 2 + 1
        (100, 16, 6, (4, 2)),   # 6 splits of 7 tiles would leave one empty: 4 splits of 2
        (100, 16, 50, (7, 1)),  # never more splits than tiles
        (17, 16, 3, (2, 1)),
    ],
)
def test_every_vocab_split_owns_at_least_one_tile(vocab, block_v, wanted, expected):
    config = tl_mod.TritonConfig(block_v=block_v, num_splits=wanted)
    num_splits, tiles_per_split = tl_mod._splits(config, 64, vocab, torch.device("cpu"))
    assert (num_splits, tiles_per_split) == expected
    num_tiles = math.ceil(vocab / block_v)
    assert (num_splits - 1) * tiles_per_split < num_tiles <= num_splits * tiles_per_split


def test_config_rejects_block_sizes_tl_dot_cannot_use():
    with pytest.raises(ValueError, match="block_v must be a power of two >= 16"):
        tl_mod.TritonConfig(block_v=48)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        tl_mod.TritonConfig(block_n=8)
    with pytest.raises(ValueError, match="num_splits must be None or an int >= 1"):
        tl_mod.TritonConfig(num_splits=0)
    hidden, weight = torch.zeros(4, 40), torch.zeros(10, 40)
    assert tl_mod.config_for(hidden, weight, None).block_d == 64
    assert tl_mod.config_for(torch.zeros(4, 20), weight[:, :20], (32, 64)) == tl_mod.TritonConfig(
        block_n=32, block_v=64, block_d=32
    )
    with pytest.raises(ValueError, match=r"chunk_size \(16, 100\).*vocab tile.*power of two >= 16; got 100"):
        tl_mod.config_for(hidden, weight, (16, 100))


# --------------------------------------------------------------------------
# Real GPUs (skipped without CUDA)
# --------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present")


def _cuda_inputs(n, d, v, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, d, device="cuda", generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, device="cuda", generator=gen) * d**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    labels[::7] = -100
    return hidden, weight, labels


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_on_cuda_matches_naive(dtype):
    hidden, weight, labels = _cuda_inputs(1000, 256, 32003, dtype)
    ours = token_logprobs_and_entropy(hidden, weight, labels, impl="triton", temperature=0.9)
    naive = token_logprobs_and_entropy(hidden, weight, labels, impl="naive", temperature=0.9)
    for a, b in zip(ours, naive):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    upstream = (torch.randn_like(ours[0]), torch.randn_like(ours[1]))
    g_ours = torch.autograd.grad(sum((o * u).sum() for o, u in zip(ours, upstream)), [hidden, weight])
    g_naive = torch.autograd.grad(sum((o * u).sum() for o, u in zip(naive, upstream)), [hidden, weight])
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(g_ours, g_naive):
        assert (a.float() - b.float()).abs().max() <= rel * b.float().abs().max()


@pytest.mark.gpu
@needs_cuda
def test_triton_on_cuda_is_faster_and_smaller_than_naive():
    hidden, weight, labels = _cuda_inputs(8192, 2048, 128256, torch.bfloat16)

    def measure(impl):
        def step():
            lp, ent = token_logprobs_and_entropy(hidden, weight, labels, impl=impl)
            (lp.sum() + ent.sum()).backward()
            hidden.grad = weight.grad = None

        step()  # compile and warm up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 3, torch.cuda.max_memory_allocated() - base

    triton_ms, triton_peak = measure("triton")
    naive_ms, naive_peak = measure("naive")
    assert triton_peak * 4 < naive_peak, f"triton peak {triton_peak / 2**20:.0f} MiB vs naive {naive_peak / 2**20:.0f}"
    assert triton_ms < naive_ms, f"triton {triton_ms:.1f} ms vs naive {naive_ms:.1f} ms per forward+backward"
