"""Cases of the Hopper kernels (``impl="triton-hopper"``), run by test_triton_hopper.py under TRITON_INTERPRET=1.

Not collected by the main run (see triton_interpreter_cases.py for why they need their own process). Shapes
are tiny (the interpreter runs ~1e4x slower than torch); 16-wide blocks still give several token blocks,
vocab tiles, vocab splits, hidden chunks and ragged last tiles, and group sizes that do not divide the
token blocks. Every number is checked against a float64 torch reference.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/kernels/test_triton_hopper.py with TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from rltk.kernels import token_logprobs_and_entropy  # noqa: E402
from rltk.kernels.logprobs import triton_token_logprobs_and_entropy  # noqa: E402
from rltk.kernels.triton_hopper import HopperConfig, hopper_backward, hopper_forward  # noqa: E402
from tests.kernels.triton_interpreter_cases import (  # noqa: E402
    IGNORE,
    assert_rel_close,
    grads,
    make_inputs,
    reference64,
    tiled_hand_inputs,
)

SMALL = dict(block_n=16, block_v=16, block_d=16)


def fp32_kernel_grads(hidden, weight, bias, labels, temperature, config, g_lp, g_ent):
    """The backward's fp32 gradients straight from the kernels (before the cast to the input dtype), and the
    float64 reference's, for per-token upstream gradients ``g_lp``, ``g_ent``."""
    logits = (hidden.double() @ weight.double().T + (0.0 if bias is None else bias.double())) / temperature
    probs = logits.softmax(-1)
    lse, expected = logits.logsumexp(-1).float(), (probs * logits).sum(-1).float()
    leaves = [None if x is None else x.detach() for x in (hidden, weight, bias)]
    ours = hopper_backward(*leaves[:2], leaves[2], labels, lse, expected,
                           g_lp.masked_fill(labels == IGNORE, 0.0) / temperature, g_ent / temperature,
                           1 / temperature, (config,), need_hidden=True, need_weight=True, need_bias=bias is not None)
    leaves64 = [None if x is None else x.double().requires_grad_() for x in leaves]
    ref = grads(reference64(leaves64[0], leaves64[1], labels, leaves64[2], temperature),
                leaves64, (g_lp.double(), g_ent.double()))
    return [g for g in ours if g is not None], ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("use_tma", [False, None])
def test_values_and_gradients_match_float64(dtype, deterministic, use_tma):
    # 21 tokens: 2 token blocks (the second ragged); V = 97: 7 vocab tiles in 3 splits; D = 40: 3 chunks
    n, d, v = 21, 40, 97
    hidden, weight, bias, labels = make_inputs(n, d, v, seed=n * v, with_bias=True, dtype=dtype)
    config = HopperConfig(**SMALL, num_splits=3, group_size=2, deterministic=deterministic, use_tma=use_tma)
    ours = triton_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, temperature=0.7, config=config)
    ref = reference64(hidden, weight, labels, bias, 0.7)  # fp64 math on the same (half) values
    for name, a, b in zip(("logprobs", "entropy"), ours, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0, msg=f"{name} vs float64")
    assert (ours[0][1::4] == 0).all(), "ignored labels must give log-prob 0"
    gen = torch.Generator().manual_seed(7)
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    fp32_grads, ref_grads = fp32_kernel_grads(hidden, weight, bias, labels, 0.7, config, g_lp, g_ent)
    for name, a, b in zip(("hidden", "weight", "bias"), fp32_grads, ref_grads):
        assert a.dtype == torch.float32
        # fp16 d-logits split in hi + lo carry ~22 bits: as exact as fp32 here
        assert_rel_close(a, b, 1e-5, f"fp32 grad {name} ({dtype}, deterministic={deterministic})")
    op_grads = grads(ours, (hidden, weight, bias), (g_lp, g_ent))
    for name, a, b, x in zip(("hidden", "weight", "bias"), op_grads, ref_grads, (hidden, weight, bias)):
        assert a.dtype == dtype and a.shape == x.shape
        tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
        assert_rel_close(a, b, tol, f"grad {name} rounded to {dtype}")


def test_fp16_dlogits_split_in_two_are_more_exact_and_small_gradients_do_not_flush():
    # Upstream gradients of 1e-7 (a token mean over 1e7 tokens): p * g is far below fp16's normal range
    # (6e-5) and would round to zero without the tile's power-of-two scale.
    n, d, v = 16, 32, 80
    hidden, weight, _, labels = make_inputs(n, d, v, seed=2, dtype=torch.float16)
    g_lp, g_ent = torch.linspace(-1, 1, n) * 1e-7, torch.linspace(0.5, 2, n) * 1e-7
    errors = {}
    for split in (False, True):
        config = HopperConfig(**SMALL, split_dlogits=split)
        ours, ref = fp32_kernel_grads(hidden, weight, None, labels, 1.0, config, g_lp, g_ent)
        errors[split] = [((a.double() - b).norm() / b.norm()).item() for a, b in zip(ours, ref)]
    assert max(errors[False]) <= 1e-3, errors  # one fp16 rounding of each d-logit: ~2^-11
    assert max(errors[True]) <= 1e-5, errors
    assert min(errors[False]) > 20 * max(errors[True]), errors


@pytest.mark.parametrize("which", [0, 1])
def test_gradient_of_one_output_alone(which):
    hidden, weight, bias, labels = make_inputs(11, 20, 45, with_bias=True, seed=which)
    ours = triton_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, config=HopperConfig(**SMALL))
    ref = reference64(hidden, weight, labels, bias)
    for a, b in zip(torch.autograd.grad(ours[which].sum(), [hidden, weight, bias]),
                    torch.autograd.grad(ref[which].sum(), [hidden, weight, bias])):
        assert_rel_close(a, b, 1e-5, f"gradient of output {which}")


def test_grouped_order_with_a_ragged_last_group_covers_every_tile_once():
    # 50 tokens: 4 token blocks in groups of 3 (3 + 1); every tile of the atomic backward is added exactly
    # once, so the gradients match float64 (a tile visited twice or never would be off by a whole tile).
    hidden, weight, bias, labels = make_inputs(50, 24, 70, with_bias=True, seed=5)
    config = HopperConfig(**SMALL, group_size=3, num_splits=2)
    ours = triton_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, config=config)
    ref = reference64(hidden, weight, labels, bias)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)
    upstream = (torch.linspace(-1, 1, 50), torch.linspace(1, -0.5, 50))
    for a, b in zip(grads(ours, (hidden, weight, bias), upstream), grads(ref, (hidden, weight, bias), upstream)):
        assert_rel_close(a, b, 1e-5, "gradient with grouped order")


def test_ignored_labels_send_no_gradient_through_the_logprob():
    hidden, weight, _, labels = make_inputs(9, 16, 33)
    logprobs, _ = triton_token_logprobs_and_entropy(hidden, weight, labels, config=HopperConfig(**SMALL))
    (grad_hidden,) = torch.autograd.grad(logprobs.sum(), [hidden])
    assert grad_hidden[1::4].abs().max() == 0
    assert grad_hidden[0].abs().max() > 0


@pytest.mark.parametrize("splits", [1, 3])
def test_sum_pi_squared_by_hand_over_tiles_and_splits(splits):
    hidden, weight, labels, expected = tiled_hand_inputs()
    out = triton_token_logprobs_and_entropy(hidden, weight, labels, with_sum_pi_squared=True,
                                            config=HopperConfig(**SMALL, num_splits=splits))
    assert len(out) == 3 and not out[2].requires_grad
    torch.testing.assert_close(out[2].double(), expected, atol=0, rtol=2e-6)


def test_public_op_takes_chunk_size_as_blocks_and_torch_determinism_as_its_mode():
    hidden, weight, bias, labels = make_inputs(18, 12, 70, seed=11, with_bias=True)
    upstream = (torch.linspace(-1, 1, 18), torch.linspace(0.2, 1, 18))
    results = []
    for deterministic in (False, True, True):
        torch.use_deterministic_algorithms(deterministic)
        try:
            out = token_logprobs_and_entropy(hidden, weight, labels, bias=bias, impl="triton-hopper",
                                             chunk_size=(16, 32))
        finally:
            torch.use_deterministic_algorithms(False)
        results.append(grads(out, (hidden, weight, bias), upstream))
    ref = reference64(hidden, weight, labels, bias)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)
    for a, b in zip(results[0], grads(ref, (hidden, weight, bias), upstream)):
        assert_rel_close(a, b, 1e-5, "atomic backward")
    for a, b, c in zip(*results):
        assert_rel_close(b, a, 1e-5, "deterministic vs atomic")
        assert torch.equal(b, c), "the deterministic backward gives the same bits twice"
    with pytest.raises(ValueError, match="triton-hopper.*power of two >= 16"):
        token_logprobs_and_entropy(hidden, weight, labels, impl="triton-hopper", chunk_size=(16, 24))


def test_forward_statistics_are_the_same_with_one_split_or_five():
    hidden, weight, bias, labels = make_inputs(16, 16, 80, with_bias=True, logit_scale=20.0, seed=5)
    args = (hidden.detach(), weight.detach(), bias.detach(), labels, 1.0)
    one = hopper_forward(*args, (HopperConfig(**SMALL, num_splits=1),), IGNORE)
    five = hopper_forward(*args, (HopperConfig(**SMALL, num_splits=5),), IGNORE)
    for a, b in zip(one[:4], five[:4]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-6)
    scale = (hidden.double() @ weight.double().T).abs().max().item()  # logits in the hundreds
    torch.testing.assert_close(five[0].double(), reference64(hidden, weight, labels, bias)[0],
                               atol=2e-7 * scale, rtol=0)


def test_non_contiguous_hidden_falls_back_to_pointer_loads():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(20, 10, generator=gen).T  # [10, 20], column-major: no TMA descriptor possible
    weight = torch.randn(19, 20, generator=gen)
    labels = torch.randint(0, 19, (10,), generator=gen)
    ours = triton_token_logprobs_and_entropy(hidden, weight, labels, config=HopperConfig(**SMALL))
    for a, b in zip(ours, reference64(hidden, weight, labels)):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)
