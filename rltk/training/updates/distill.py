"""The teacher of on-policy distillation: loaded once, checked against the student's tokenizer, frozen.

The teacher scores the tokens the student sampled, exactly as a KL reference does, so it *is* a
:class:`rltk.training.step.reference.FrozenReference` holding another model instead of a copy of the policy.
Its log-probs are only meaningful on the student's token ids: a teacher whose tokenizer maps text to
other ids (another vocabulary, other merges, other special tokens) would score tokens it never meant,
so it is refused before anything trains.
"""

from __future__ import annotations

from pathlib import Path

from rltk.checkpoint import STATE_FILE
from rltk.errors import ConfigError
from rltk.strategies.base import MODEL_SUBDIR
from rltk.training.step.reference import FrozenReference

KEY = "distill.teacher_path"
#: Digits, letters, spaces, newlines and punctuation: a text on which two tokenizers that differ in any
#: common token give different ids (the tiny task's prompts are made of these).
PROBE_TEXT = "Q: 17+25=?\n  A: 42.  Hello, World!\t#### 7 \\boxed{3/4} <answer>(1+2)*3</answer> 0123456789"
TOKENIZER_SUBDIR = "tokenizer"  # where a run keeps its tokenizer (<output_dir>/tokenizer)


def teacher_folders(path: str) -> tuple[Path, Path]:
    """``(model folder, tokenizer folder)`` of ``distill.teacher_path``: an HF folder holds both; an rltk
    checkpoint (``<output_dir>/checkpoints/step_XXXXXX``) holds the weights in ``model/`` and its run keeps
    the tokenizer at ``<output_dir>/tokenizer``."""
    if not path:
        raise ConfigError(f"'{KEY}' is not set: on-policy distillation needs a teacher. Give a Hugging Face "
                          f"causal-LM folder or an rltk checkpoint, e.g. {KEY}=runs/sft-tiny/checkpoints/"
                          f"step_001500 (model.path is the student)")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"bad value '{path}' for '{KEY}': "
                          f"{'no such folder' if not folder.exists() else 'a file, not a folder'}; give a Hugging "
                          f"Face causal-LM folder or an rltk checkpoint (<output_dir>/checkpoints/step_XXXXXX)")
    if (folder / STATE_FILE).is_file():
        model_dir = folder / MODEL_SUBDIR
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"bad value '{path}' for '{KEY}': this checkpoint holds no full model folder "
                              f"({MODEL_SUBDIR}/config.json; a LoRA or DeepSpeed checkpoint): make one with "
                              f"`rltk export {path} OUT [--merge]` and set {KEY}=OUT")
        return model_dir, folder.parent.parent / TOKENIZER_SUBDIR
    return folder, folder


def tokenizer_mismatch(student, teacher) -> str | None:
    """Why ``teacher``'s tokenizer cannot score ``student``'s tokens, or None when they agree.

    They agree when the vocabularies are the same token -> id map, the special tokens (eos, pad, bos)
    have the same ids, and a probe text of digits, letters and punctuation encodes to the same ids.
    """
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab) - set(t_vocab))
        only_t = sorted(set(t_vocab) - set(s_vocab))
        moved = sorted(tok for tok in set(s_vocab) & set(t_vocab) if s_vocab[tok] != t_vocab[tok])
        parts = [f"student vocabulary {len(s_vocab)} tokens, teacher {len(t_vocab)}"]
        if only_s:
            parts.append(f"only the student's: {only_s[:5]}")
        if only_t:
            parts.append(f"only the teacher's: {only_t[:5]}")
        if moved:
            parts.append(f"other ids for {moved[:5]}")
        return "; ".join(parts)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return f"{name} is {getattr(student, name, None)} for the student, {getattr(teacher, name, None)} " \
                   f"for the teacher"
    s_ids = student(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    t_ids = teacher(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if s_ids != t_ids:
        return f"the same text encodes to other ids ({s_ids[:12]}... vs {t_ids[:12]}...)"
    return None


def load_teacher(path: str | None, student_tokenizer, strategy, *, dtype: str = "float32") -> FrozenReference:
    """The teacher of ``distill.teacher_path``, frozen on the strategy's device, as a reference whose
    :meth:`~rltk.training.step.reference.FrozenReference.logprobs` are the ``teacher_logprobs`` of a batch.

    Raises :class:`ConfigError` (``rltk run`` exits 2) when the key is unset, the folder is not a model,
    or its tokenizer is not the student's.
    """
    from rltk.models.loading import ensure_pad_token, load_model, load_tokenizer

    model_dir, tokenizer_dir = teacher_folders(path)
    try:
        teacher_tokenizer = ensure_pad_token(load_tokenizer(tokenizer_dir, config_key=KEY))
        teacher = load_model(model_dir, dtype=dtype, config_key=KEY)
    except (OSError, ValueError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(text if KEY in text else f"bad value '{path}' for '{KEY}': cannot load it: {text}") from exc
    why = tokenizer_mismatch(student_tokenizer, teacher_tokenizer)
    if why is None and teacher.get_output_embeddings().weight.shape[0] < len(student_tokenizer):
        why = (f"the teacher's output layer has {teacher.get_output_embeddings().weight.shape[0]} rows, fewer than "
               f"the {len(student_tokenizer)} tokens of the student's tokenizer")
    if why is not None:
        raise ConfigError(f"bad value '{path}' for '{KEY}': the teacher's tokenizer is not the student's "
                          f"({why}). On-policy distillation scores the student's token ids with the teacher, so "
                          f"both must share one tokenizer")
    return FrozenReference(strategy, teacher.to(strategy.device).eval().requires_grad_(False))
