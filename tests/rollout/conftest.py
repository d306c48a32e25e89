"""A tiny Qwen2 and a character tokenizer, built here so these tests need nothing else."""

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHARS = "0123456789+-*=() abcdefghijklmnopqrstuvwxyz#:."


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; <pad> 0, <eos> 1, <unk> 2."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for char in CHARS:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_model(vocab_size: int, seed: int = 0, init: float = 0.3) -> Qwen2ForCausalLM:
    """A random 2-layer Qwen2; a large init spreads the logits so argmax ties cannot happen."""
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
        initializer_range=init, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


@pytest.fixture(autouse=True)
def one_thread():
    # A model this small runs ~10x faster on one thread than on two contended ones.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def model(tokenizer):
    return build_model(len(tokenizer))


@pytest.fixture
def encode(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
