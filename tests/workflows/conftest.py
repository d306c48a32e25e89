"""The tiny Qwen2 and character tokenizer of the rollout tests, shared rather than copied."""

from tests.rollout.conftest import build_model, build_tokenizer, encode, one_thread, tokenizer  # noqa: F401
