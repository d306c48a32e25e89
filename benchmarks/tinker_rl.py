"""Benchmark: the tinker-cookbook RL loop, driven by the official ``tinker`` SDK against ``rltk serve-tinker``.

    python benchmarks/tinker_rl.py                       # seeds 0 1 2, the tiny model (~1 min)
    python benchmarks/tinker_rl.py --seeds 0 1 2 3 4
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/tinker_rl.py

The loop is tinker-cookbook's ``rl/train.py`` pattern written against the SDK directly (the
cookbook 0.6 needs ``tml-renderers``, which the package registry here lacks): a LoRA training
client on the served tiny model; a short supervised warm-up (``cross_entropy``) on eight
single-digit sums of the embedded arithmetic task (the same eight throughout: a tiny random model
with LoRA learns a few problems, not arithmetic), so that some answers are right; then per step
``save_weights_and_get_sampling_client``, groups of samples per prompt, reward 1 for the right
answer, advantages centred within each group (groups with one reward dropped, as the cookbook
does), ``forward_backward`` with ``importance_sampling`` on the sampler's log-probs, and
``optim_step``. It prints the mean reward of the first and last ``--window`` RL steps per seed,
and their gain; ``tests/recipes/test_tinker_rl.py`` runs the same loop and asserts half the
smallest gain measured here.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

API_KEY = "tml-benchmark"
SERVER_WAIT_S = 180.0


def start_server(*extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``rltk serve-tinker --port 0 ...`` in a subprocess; returns it and its base URL once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "rltk.commands.cli", "serve-tinker", "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + SERVER_WAIT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        found = re.search(r"at (http://\S+) ", line or "")
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"rltk serve-tinker exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
    proc.kill()
    raise TimeoutError(f"rltk serve-tinker did not print its URL within {SERVER_WAIT_S:.0f} s")


def arithmetic_rows(seed: int, size: int) -> list[dict]:
    from rltk.data.synthetic import arithmetic

    return arithmetic("train", size, seed, min_digits=1, max_digits=1, operators="+")


def sft_datum(tokenizer, prompt: str, answer: str):
    """Prompt + answer + eos, trained on the answer and eos only (weights 0 on the prompt)."""
    import numpy as np
    from tinker import types

    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    tokens = prompt_ids + tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    weights = np.array([0.0] * (len(prompt_ids) - 1) + [1.0] * (len(tokens) - len(prompt_ids)), dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": weights})


def rl_datum(prompt_ids: list[int], sequence, advantage: float):
    """The cookbook's datum for one sample: log-probs and advantages on the sampled tokens only."""
    import numpy as np
    from tinker import types

    tokens = prompt_ids + list(sequence.tokens)
    n_prompt = len(prompt_ids) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                        "logprobs": np.array([0.0] * n_prompt + list(sequence.logprobs), dtype=np.float32),
                        "advantages": np.array([0.0] * n_prompt + [advantage] * len(sequence.tokens),
                                               dtype=np.float32)})


def rl_loop(base_url: str, *, seed: int, api_key: str = API_KEY, problems: int = 8, sft_steps: int = 60,
            rl_steps: int = 20, prompts_per_step: int = 8, group_size: int = 16, rank: int = 16, sft_lr: float = 1e-2,
            rl_lr: float = 1e-3, verbose: bool = False) -> dict:
    """Warm-up then RL on single-digit sums; returns the supervised losses and each RL step's mean reward."""
    import random

    import tinker
    from tinker import types

    from rltk.models.tiny import build_char_tokenizer
    from rltk.rewards.verifiable.math import answers_match

    tokenizer = build_char_tokenizer()
    rows = arithmetic_rows(seed, problems)
    rng = random.Random(seed)
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    started = time.monotonic()
    try:
        client = service.create_lora_training_client(base_model="tiny", rank=rank, seed=seed).result()
        losses = []
        for _ in range(sft_steps):  # supervised warm-up: the cookbook's sl loop
            batch = rows
            fwd = client.forward_backward([sft_datum(tokenizer, r["prompt"], r["ground_truth"]) for r in batch],
                                          "cross_entropy")
            step = client.optim_step(types.AdamParams(learning_rate=sft_lr))
            losses.append(fwd.result().metrics["loss:sum"] / len(batch))
            step.result()
        if verbose:
            print(f"  warm-up loss {losses[0]:.3f} -> {losses[-1]:.3f} ({time.monotonic() - started:.0f} s)", flush=True)
        rewards = []
        for step in range(rl_steps):
            sampler = client.save_weights_and_get_sampling_client()
            batch = rng.sample(rows, prompts_per_step)
            prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in batch]
            # seeded per request: the run is the same every time at one CPU level, so the test sees the benchmark's
            futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=group_size,
                                      sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0,
                                                                           seed=seed * 100_000 + step * 100 + i))
                       for i, p in enumerate(prompts)]
            data, step_rewards = [], []
            for row, prompt_ids, future in zip(batch, prompts, futures):
                sequences = future.result().sequences
                group = [float(answers_match(tokenizer.decode(s.tokens, skip_special_tokens=True).strip(),
                                             row["ground_truth"])) for s in sequences]
                step_rewards.extend(group)
                mean = sum(group) / len(group)
                if all(g == group[0] for g in group):
                    continue  # no signal: the cookbook drops constant-reward groups
                data.extend(rl_datum(prompt_ids, s, g - mean) for s, g in zip(sequences, group))
            rewards.append(sum(step_rewards) / len(step_rewards))
            if verbose:
                print(f"  rl step {len(rewards)}: reward {rewards[-1]:.3f} ({time.monotonic() - started:.0f} s)",
                      flush=True)
            if data:
                fwd = client.forward_backward(data, "importance_sampling")
                client.optim_step(types.AdamParams(learning_rate=rl_lr)).result()
                fwd.result()
        return {"losses": losses, "rewards": rewards}
    finally:
        service.close("success").result()


def gain(rewards: list[float], window: int) -> float:
    return sum(rewards[-window:]) / window - sum(rewards[:window]) / window


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--rl-lr", type=float, default=1e-3)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    proc, url = start_server("--api-key", API_KEY, "--threads", "1")
    try:
        print(f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(best)')}  server {url}")
        print(f"{'seed':>4} {'sft loss first':>14} {'last':>6} {'reward first':>12} {'last':>6} {'gain':>6} {'s':>5}")
        gains = []
        for seed in args.seeds:
            start = time.monotonic()
            result = rl_loop(url, seed=seed, rl_steps=args.rl_steps, rl_lr=args.rl_lr)
            r = result["rewards"]
            gains.append(gain(r, args.window))
            print(f"{seed:>4} {result['losses'][0]:>14.3f} {result['losses'][-1]:>6.3f} "
                  f"{sum(r[:args.window]) / args.window:>12.3f} {sum(r[-args.window:]) / args.window:>6.3f} "
                  f"{gains[-1]:>6.3f} {time.monotonic() - start:>5.0f}", flush=True)
        print(f"min gain {min(gains):.3f}  (the test asserts half of it)")
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
