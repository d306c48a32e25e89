"""AccelerateStrategy in one process: schedule, clipping, skipping, accumulation, precision, save/load."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import rltk
from rltk.strategies.accelerate_strategy import AccelerateStrategy
from rltk.strategies.base import TrainingStrategy


def tiny_qwen2(seed: int = 0, tie: bool = False) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=50,
                                      tie_word_embeddings=tie)
    return transformers.Qwen2ForCausalLM(config)


class Dot(nn.Module):
    """y = w . x with w = (0, 0): its gradient is exactly the input, which makes clipping checkable by hand."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return (self.w * x).sum()


def strategy_for(model: nn.Module, **setup) -> AccelerateStrategy:
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(model, **{"lr": 0.1, "total_steps": 10, **setup})
    return strategy


def test_registered_as_training_strategy_accelerate():
    assert rltk.get_component("training_strategy", "accelerate") is AccelerateStrategy
    assert issubclass(AccelerateStrategy, TrainingStrategy)


def test_single_process_defaults():
    strategy = AccelerateStrategy(cpu=True)
    assert (strategy.rank, strategy.world_size, strategy.is_main, strategy.device.type) == (0, 1, True, "cpu")
    assert torch.equal(strategy.all_reduce_sum(torch.tensor([2.0, 3.0])), torch.tensor([2.0, 3.0]))
    assert strategy.all_gather_object({"a": 1}) == [{"a": 1}]
    assert strategy.broadcast_object("x") == "x"
    strategy.barrier()


def test_using_the_strategy_before_setup_says_what_to_call():
    strategy = AccelerateStrategy(cpu=True)
    with pytest.raises(RuntimeError, match=r"AccelerateStrategy.step\(\) needs setup\(model, lr=..., total_steps=...\)"):
        strategy.step()
    with pytest.raises(RuntimeError, match="AccelerateStrategy.model needs setup"):
        strategy.model


def test_setup_twice_is_refused():
    strategy = strategy_for(Dot())
    with pytest.raises(RuntimeError, match="setup\\(\\) was already called"):
        strategy.setup(Dot(), lr=0.1, total_steps=10)


def test_bad_constructor_arguments_are_named():
    with pytest.raises(ValueError, match="unknown mixed_precision 'fp8'"):
        AccelerateStrategy(cpu=True, mixed_precision="fp8")
    with pytest.raises(ValueError, match="mixed_precision='fp16' needs a CUDA device"):
        AccelerateStrategy(cpu=True, mixed_precision="fp16")
    with pytest.raises(TypeError, match="seed='1' must be an integer"):
        AccelerateStrategy(cpu=True, seed="1")


def test_step_reports_the_lr_it_used_following_the_schedule():
    strategy = strategy_for(Dot(), lr=0.1, total_steps=10, warmup_steps=2, lr_schedule="linear")
    lrs = []
    for _ in range(5):
        strategy.backward(strategy.model(torch.tensor([1.0, 1.0])))
        lrs.append(strategy.step()["lr"])
    # 0.1 * [(0+1)/2, (1+1)/2, 1 - 0/8, 1 - 1/8, 1 - 2/8]
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.0875, 0.075])
    assert strategy.optimizer_steps == 5
    assert strategy.current_lr == pytest.approx(0.1 * (1 - 3 / 8))


def test_clipping_scales_the_gradient_to_the_max_norm_and_reports_the_norm_before():
    strategy = strategy_for(Dot(), grad_clip=1.0, betas=(0.9, 0.999))
    strategy.backward(strategy.model(torch.tensor([3.0, 4.0])))  # gradient (3, 4), norm 5
    info = strategy.step()
    assert info["grad_norm"] == pytest.approx(5.0)
    assert info["skipped"] == 0.0
    state = strategy.optimizer.state[strategy.unwrap().w]
    # Adam's first moment after one step is (1 - beta1) * clipped gradient = 0.1 * (0.6, 0.8)
    assert state["exp_avg"].tolist() == pytest.approx([0.06, 0.08], rel=1e-5)
    assert state["exp_avg_sq"].tolist() == pytest.approx([0.001 * 0.36, 0.001 * 0.64], rel=1e-5)


def test_no_clipping_when_grad_clip_is_none():
    strategy = strategy_for(Dot(), grad_clip=None)
    strategy.backward(strategy.model(torch.tensor([3.0, 4.0])))
    assert strategy.step()["grad_norm"] == pytest.approx(5.0)
    assert strategy.optimizer.state[strategy.unwrap().w]["exp_avg"].tolist() == pytest.approx([0.3, 0.4], rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_skips_the_update_and_the_schedule(bad, caplog):
    model = Dot()
    strategy = strategy_for(model, warmup_steps=4)
    strategy.backward(strategy.model(torch.tensor([bad, 1.0])))
    info = strategy.step()
    assert info["skipped"] == 1.0 and not torch.isfinite(torch.tensor(info["grad_norm"]))
    assert model.w.tolist() == [0.0, 0.0]
    assert model.w.grad is None
    assert strategy.optimizer_steps == 0 and strategy.skipped_steps == 1
    assert "optimizer step 1 skipped" in caplog.text
    # the next finite step is a normal first step: lr of warm-up step 0
    strategy.backward(strategy.model(torch.tensor([1.0, 1.0])))
    info = strategy.step()
    assert info == {"grad_norm": pytest.approx(2 ** 0.5), "lr": pytest.approx(0.1 / 4), "skipped": 0.0}
    assert strategy.loss_scale is None  # fp32: no loss scaling
    assert strategy.optimizer_steps == 1


def _token_loss_sum(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits
    token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return (token_loss * mask[:, 1:]).sum()


def test_two_micro_batches_with_global_normalisation_equal_one_big_batch():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (4, 9), generator=generator)
    mask = (torch.arange(9)[None] < torch.tensor([[9], [4], [7], [3]])).long()
    global_tokens = mask[:, 1:].sum()

    # lr 1e-3: Adam divides by sqrt(v), which turns 1e-7 gradient rounding on near-zero entries into
    # lr-sized relative noise; the gradients themselves are compared first, exactly where it matters.
    big = strategy_for(tiny_qwen2(0), lr=1e-3)
    big.backward(_token_loss_sum(big.model, ids, mask) / global_tokens)
    big_grads = {n: p.grad.clone() for n, p in big.unwrap().named_parameters()}

    accumulated = strategy_for(tiny_qwen2(0), lr=1e-3)
    for i, rows in enumerate([slice(0, 2), slice(2, 4)]):
        with accumulated.accumulate(i == 1):
            accumulated.backward(_token_loss_sum(accumulated.model, ids[rows], mask[rows]) / global_tokens)
    for name, param in accumulated.unwrap().named_parameters():
        torch.testing.assert_close(param.grad, big_grads[name], rtol=0, atol=1e-6, msg=name)
    assert accumulated.step()["grad_norm"] == pytest.approx(big.step()["grad_norm"], rel=1e-6)
    for a, b in zip(accumulated.unwrap().parameters(), big.unwrap().parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_backward_in_one_process_is_plain_backward():
    model, reference = Dot(), Dot()
    strategy = strategy_for(model)
    strategy.backward(strategy.model(torch.tensor([0.5, -2.0])) * 3)
    (reference(torch.tensor([0.5, -2.0])) * 3).backward()
    assert torch.equal(model.w.grad, reference.w.grad)


def test_bf16_autocast_runs_matmuls_in_bf16_and_keeps_fp32_master_weights():
    layer = nn.Linear(4, 4)
    strategy = AccelerateStrategy(cpu=True, mixed_precision="bf16")
    strategy.setup(layer, lr=0.1, total_steps=2)
    with strategy.autocast():
        out = strategy.model(torch.ones(1, 4))
    assert out.dtype == torch.bfloat16
    strategy.backward(out.float().sum())
    strategy.step()
    assert layer.weight.dtype == torch.float32
    full = AccelerateStrategy(cpu=True)
    full.setup(nn.Linear(4, 4), lr=0.1, total_steps=2)
    with full.autocast():
        assert full.model(torch.ones(1, 4)).dtype == torch.float32


def test_full_state_dict_is_a_detached_cpu_copy():
    model = tiny_qwen2(0)
    strategy = strategy_for(model)
    weights = strategy.full_state_dict()
    assert weights.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor) and weights[name].device.type == "cpu"
    weights["model.norm.weight"].add_(1.0)
    assert not torch.equal(weights["model.norm.weight"], model.model.norm.weight)


def _train(strategy, steps: int, seed: int = 7):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 50, (2, 6), generator=generator)
        mask = torch.ones_like(ids)
        strategy.backward(_token_loss_sum(strategy.model, ids, mask) / mask[:, 1:].sum())
        strategy.step()


@pytest.mark.parametrize("tie", [False, True])
def test_save_then_load_restores_weights_optimizer_and_schedule_exactly(tmp_path, tie):
    setup = dict(lr=1e-2, total_steps=8, warmup_steps=2, lr_schedule="cosine", weight_decay=0.1)
    strategy = strategy_for(tiny_qwen2(0, tie=tie), **setup)
    _train(strategy, 3)
    strategy.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "optimizer.pt", "scheduler.pt", "strategy.json"]
    meta = json.loads((tmp_path / "strategy.json").read_text())
    assert meta["format"] == "rltk-accelerate-v1" and meta["optimizer_steps"] == 3

    restored = strategy_for(tiny_qwen2(1, tie=tie), **setup)
    restored.load(tmp_path)
    for (name, a), b in zip(strategy.unwrap().named_parameters(), restored.unwrap().parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(strategy.unwrap().parameters(), restored.unwrap().parameters()):
        for key, value in strategy.optimizer.state[a].items():
            assert torch.equal(value, restored.optimizer.state[b][key])
    assert restored.optimizer_steps == 3 and restored.current_lr == strategy.current_lr
    if tie:
        assert restored.unwrap().lm_head.weight is restored.unwrap().model.embed_tokens.weight


def test_saved_model_folder_is_a_loadable_hugging_face_model(tmp_path):
    strategy = strategy_for(tiny_qwen2(0))
    _train(strategy, 1)
    strategy.save(tmp_path)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, strategy.unwrap()(ids).logits, rtol=0, atol=0)


def test_plain_module_checkpoint_uses_model_safetensors(tmp_path):
    strategy = strategy_for(Dot())
    strategy.save(tmp_path)
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_loading_a_checkpoint_of_another_model_names_the_keys(tmp_path):
    strategy_for(tiny_qwen2(0)).save(tmp_path)
    other = strategy_for(Dot())
    with pytest.raises(KeyError, match=r"do not match the model \(Dot\): missing \['w'\]"):
        other.load(tmp_path)


def test_loading_something_that_is_not_a_checkpoint(tmp_path):
    strategy = strategy_for(Dot())
    with pytest.raises(FileNotFoundError, match="has no strategy.json: it is not a checkpoint written by"):
        strategy.load(tmp_path)
    (tmp_path / "strategy.json").write_text(json.dumps({"format": "rltk-deepspeed-v1", "strategy": "Deep"}))
    with pytest.raises(ValueError, match="format 'rltk-deepspeed-v1'.*reads 'rltk-accelerate-v1'"):
        strategy.load(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 loss scaling needs a CUDA device")
def test_fp16_overflow_skips_the_step_and_halves_the_loss_scale():
    model = Dot()
    strategy = AccelerateStrategy(cpu=False, mixed_precision="fp16")
    strategy.setup(model, lr=0.1, total_steps=4)
    scale = strategy.loss_scale
    strategy.backward(strategy.model(torch.tensor([1e36, 1.0], device=strategy.device)))  # x 65536 overflows fp32
    info = strategy.step()
    assert info["skipped"] == 1.0 and info["loss_scale"] == scale / 2
    assert model.w.tolist() == [0.0, 0.0]
    strategy.backward(strategy.model(torch.tensor([3.0, 4.0], device=strategy.device)))
    assert strategy.step()["grad_norm"] == pytest.approx(5.0)  # reported unscaled
