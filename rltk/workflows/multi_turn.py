"""Workflow ``multi_turn``: episodes of several turns with an environment and/or tools.

rltk drives the loop: generate -> parse tool calls -> tools / environment step
-> observation -> generate ... All live episodes of a step advance together:
each turn is **one** batched engine call over every episode still running, not
one call per episode (``benchmarks/multi_turn.py`` measures the difference).

Token-in, token-out. An episode's ids are exactly what the engine received and
produced: the opening messages are rendered once (chat template, tool schemas,
generation prompt); each assistant turn appends the engine's own ids and
log-probs; each observation appends only its newly rendered ids
(:class:`rltk.workflows.chat.TurnRenderer`). Nothing is ever re-tokenized.

The experience of an episode::

    prompt_ids     the opening messages with the generation prompt
    response_ids   turn 1 | observation 1 (+ generation prompt) | turn 2 | ... | last turn
    response_mask  1 on assistant-turn tokens, 0 on observation/template tokens
    rollout_logprobs  the engine's log-probs on turn tokens, 0 on observation tokens
    turn_rewards   (position of the last token of turn k, environment reward of turn k)
    score          sum of the environment rewards + the reward function's score of the last turn

Who answers an assistant turn:

* With tools configured (``env.tools``) and a turn that calls tools (or
  tries to and fails to parse), the workflow runs the calls and appends one
  ``tool`` message per call (the result, or ``"error: ..."``). A malformed
  call, an unknown tool, arguments the schema refuses and a tool that raises
  all become error observations the model sees, counted in the metrics.
* Otherwise, with an environment (``env.environment``), ``env.step(turn)``
  answers: its observation, its reward (on the turn's last token), ``done``.
* Otherwise (tools only, no call in the turn) the episode is over: that turn
  is the final answer.

An episode ends when the environment says ``done``, when it has run
``env.max_turns`` assistant turns, when the response (turns + observations)
would exceed ``env.max_total_tokens`` (the last turn is cut to fit, and an
observation that would not fit is not appended), or when the environment
raises. The limits flag the episode ``truncated`` (``finish_reason
"length"``). An environment that raises in ``step`` ends its episode with the
reward's ``fallback`` score (``reward.fallback``, the score a failing reward
function gives) and no turn rewards; one that raises in ``reset`` (or
returns messages the template cannot render) has no opening to train on, so
the episode is dropped. Both are counted (``rollout/env_errors``) and training
goes on.

Images. With a vision-language policy (``processor``), messages may hold image parts: a row's
``{"type": "image"}`` parts take its ``images``, an environment's opening or observation carries its own
(``{"type": "image", "image": ...}``). They go through the processor as their messages are appended, every
later turn is generated with all the images shown so far, and the experience keeps them
(``Experience.vision``); see :mod:`rltk.workflows.vision_turns`.

The reward function scores the final answer as in ``single_turn``: its
``prompt`` is the row's ``prompt`` (else the opening rendered as text) and its
``response`` the decoded last assistant turn.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import rltk
from rltk.batch import Experience, PromptImages
from rltk.environments.base import AssistantTurn, Environment, check_messages, check_step_result
from rltk.registry import get_registry
from rltk.rollout.base import RolloutEngine, SamplingParams
from rltk.tools.resolve import resolve_tools
from rltk.workflows.base import (
    GroupNumbering, Workflow, check_rows, check_workflow_parts, held_out_metrics,
)
from rltk.workflows.chat import TurnRenderer, generate_checked, render_text, row_messages, score_responses
from rltk.workflows.vision_turns import image_count, image_parts, join_images, transcript_record, with_row_images

#: The ``env`` config section's keys and defaults (rltk.config.schema.EnvConfig mirrors them).
ENV_DEFAULTS: dict[str, Any] = {
    "environment": None, "environment_args": {}, "tools": [], "tools_args": {}, "mcp_servers": {}, "tool_parser": "hermes",
    "tool_parser_args": {}, "max_turns": 4, "max_new_tokens_per_turn": None, "max_total_tokens": 256,
}


@dataclass
class _Episode:
    """One running episode: its transcript as messages and as ids, and its counters."""

    row_index: int
    sample_index: int
    env: Environment | None
    messages: list[dict]
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    env_infos: list[dict] = field(default_factory=list)
    vision: PromptImages | None = None  # every image shown so far, in order (rltk.workflows.vision_turns)
    last_text: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    parse_errors: int = 0
    env_error: str | None = None
    stop_reason: str | None = None  # done | answered | max_turns | max_total_tokens | env_error

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def truncated(self) -> bool:
        return self.stop_reason in ("max_turns", "max_total_tokens")


class MultiTurnWorkflow(GroupNumbering, Workflow):
    """Rows -> ``n`` multi-turn episodes each -> experiences (registered as ``multi_turn``).

    Args:
        engine: the rollout engine.
        tokenizer: a tokenizer with a chat template (rendered with ``tools=``).
        reward: scores each episode's final answer, as for ``single_turn``.
        sampling: sampling parameters; ``n`` episodes per row form one group.
            Each turn is generated with ``n=1`` per episode and
            ``env.max_new_tokens_per_turn`` tokens at most.
        env: the ``env`` config section (keys of :data:`ENV_DEFAULTS`; missing
            keys take those defaults, ``max_new_tokens_per_turn`` that of
            ``sampling.max_new_tokens``). Filled in by the recipe.
        processor: a vision-language policy's processor (None for a text policy): images in the opening
            (a row's ``images``, an environment's ``reset``) and in observations go through it, and every
            turn is generated with the episode's images so far (:mod:`rltk.workflows.vision_turns`).

    Episodes are numbered into groups by a counter kept in :meth:`state_dict`.
    """

    workflow_name = "multi_turn"

    def __init__(self, *, engine: RolloutEngine, tokenizer: Any, reward: Any, sampling: SamplingParams,
                 env: Mapping[str, Any] | None = None, processor: Any = None):
        check_workflow_parts(self.workflow_name, sampling, reward)
        self.engine, self.tokenizer, self.reward, self.sampling = engine, tokenizer, reward, sampling
        cfg = _env_config(env, sampling)
        self.env_config = cfg
        self.environment_cls = None
        if cfg["environment"] is not None:
            self.environment_cls = get_registry().entry("environment", cfg["environment"],
                                                        where="env.environment").obj
        self.environment_args = dict(cfg["environment_args"])
        if self.environment_cls is not None and hasattr(self.environment_cls, "check_args"):
            # once, before any episode: a bad argument or an unreachable server stops the run here
            self.environment_cls.check_args(**self.environment_args)
        # keyed by the name the model calls (an MCP server's tool: the server's name for it)
        self.tools = {tool.name: tool for tool in resolve_tools(cfg)}
        parser_cls = get_registry().entry("tool_parser", cfg["tool_parser"], where="env.tool_parser").obj
        self.parser = parser_cls(**dict(cfg["tool_parser_args"]))
        self.max_turns = cfg["max_turns"]
        self.max_new_tokens_per_turn = cfg["max_new_tokens_per_turn"]
        self.max_total_tokens = cfg["max_total_tokens"]
        self.processor = processor
        self.renderer = TurnRenderer(tokenizer, [t.schema() for t in self.tools.values()], processor)
        self.fallback = float(getattr(reward, "fallback", 0.0))
        self._next_group_id = 0
        self._metrics: dict[str, float] = {}
        self._warned_env = False

    # ------------------------------------------------------------------ training rollouts

    def run(self, rows: list[dict], *, greedy_baseline: bool = False) -> list[Experience]:
        """``sampling.n`` episodes per row, one group per row, as experiences in row order.

        With ``greedy_baseline=True`` each row also runs one greedy episode
        (not trained on) whose score is the ``baseline_score`` of the row's
        experiences (ReMax, Li et al. 2023, arXiv:2310.10505).
        """
        rows = check_rows(rows, "multi_turn", prompt_required=False)
        if not rows:
            self._metrics = {}
            return []
        tick = time.perf_counter()
        episodes, stats = self._rollout(rows, self.sampling)
        baselines = None
        if greedy_baseline:
            greedy, _ = self._rollout(rows, replace(self.sampling, n=1, greedy=True))
            greedy_scores = self._score(rows, greedy)
            baselines = {e.row_index: score for e, (score, _, _) in zip(greedy, greedy_scores)}
        generate_s = time.perf_counter() - tick - stats["env_s"]
        tick = time.perf_counter()
        scored = self._score(rows, episodes)
        reward_s = time.perf_counter() - tick
        experiences = []
        group_of_row = {}
        for index in range(len(rows)):
            group_of_row[index] = self.new_group_id()
        for episode, (score, details, reward_fn_score) in zip(episodes, scored):
            row = rows[episode.row_index]
            experiences.append(self._experience(row, episode, score, details, reward_fn_score,
                                                group_of_row[episode.row_index],
                                                None if baselines is None else baselines.get(episode.row_index)))
        self._metrics = _metrics(experiences, stats, generate_s, reward_s)
        if baselines:
            self._metrics["rollout/greedy_baseline_score"] = sum(baselines.values()) / len(baselines)
        return experiences

    def evaluate(self, rows: list[dict], params: SamplingParams | None = None, *,
                 threshold: float = 1.0) -> dict[str, float]:
        """Held-out metrics: one greedy episode per row by default.

        Returns ``accuracy`` (episodes whose score, environment rewards plus
        the reward function's, is ``>= threshold``), ``mean_score``,
        ``mean_turns``, ``mean_response_length`` (response tokens, observations
        included), ``truncated_fraction`` and ``num_responses`` (0, with every
        other entry 0, when every environment failed to open its episode). ``params``
        chooses the decoding (``n``, greedy, temperature ...); each turn's
        length limit stays ``env.max_new_tokens_per_turn``.
        """
        rows = check_rows(rows, "multi_turn", prompt_required=False)
        if not rows:
            raise ValueError("multi_turn.evaluate() got no rows; give it the held-out split")
        params = params if params is not None else replace(self.sampling, n=1, greedy=True)
        episodes, _ = self._rollout(rows, params)
        if not episodes:  # every reset failed (warned and counted): report it, do not end the run
            return {"accuracy": 0.0, "mean_score": 0.0, "mean_turns": 0.0, "mean_response_length": 0.0,
                    "truncated_fraction": 0.0, "num_responses": 0.0}
        scores = [score for score, _, _ in self._score(rows, episodes)]
        metrics = held_out_metrics(scores, [len(e.response_ids) for e in episodes],
                                   sum(e.truncated for e in episodes), threshold)
        return {**metrics, "mean_turns": sum(e.turns for e in episodes) / len(scores)}

    def metrics(self) -> dict[str, float]:
        """The last :meth:`run`: ``rollout/turns_mean``, ``rollout/tool_calls`` and ``rollout/tool_errors``
        (per episode), ``rollout/tool_parse_errors``, ``rollout/env_errors`` (count),
        ``rollout/env_reward_mean`` vs ``rollout/reward_fn_mean``, ``rollout/truncated_fraction``,
        ``rollout/engine_calls``, lengths, timings and each reward function's mean."""
        return dict(self._metrics)

    # ------------------------------------------------------------------ the episode loop

    def _rollout(self, rows: list[dict], params: SamplingParams) -> tuple[list[_Episode], dict]:
        """Run ``params.n`` episodes per row to the end, all live episodes stepping together."""
        stats = {"engine_calls": 0, "env_errors": 0, "env_s": 0.0}
        episodes = self._open(rows, params.n, stats)
        turn = 0
        while True:
            live = [e for e in episodes if not e.done]
            if not live:
                break
            limits = [min(self.max_new_tokens_per_turn, self.max_total_tokens - len(e.response_ids)) for e in live]
            seed = None if params.seed is None else params.seed + turn  # a fresh stream per turn, reproducible
            turn_params = replace(params, n=1, max_new_tokens=max(limits), seed=seed)
            visions = [e.vision for e in live]  # every image shown so far, for the policy to see this turn
            shown = visions if any(v is not None for v in visions) else None
            groups = generate_checked(self.engine, [e.prompt_ids + e.response_ids for e in live], turn_params,
                                      "multi_turn", vision_inputs=shown)
            stats["engine_calls"] += 1
            tick = time.perf_counter()
            for episode, limit, (completion,) in zip(live, limits, groups):
                self._advance(episode, completion, limit, stats)
            stats["env_s"] += time.perf_counter() - tick
            turn += 1
        return episodes, stats

    def _open(self, rows: list[dict], n: int, stats: dict) -> list[_Episode]:
        episodes, cache = [], {}
        for index, row in enumerate(rows):
            where = f"multi_turn: row {index} (id {row.get('id', str(index))!r})"
            for sample in range(n):
                env = None
                if self.environment_cls is not None:
                    try:
                        env = self.environment_cls(**self.environment_args)
                        # an opening that keeps the row's {"type": "image"} parts shows the row's images
                        opening = with_row_images(check_messages(env.reset(dict(row)), f"{where}: reset()"), row,
                                                  where, all_shown=False)
                        prompt_ids, vision = self._opening_ids(opening, cache, where)
                    except Exception as exc:  # the environment's failure: drop this episode only
                        stats["env_errors"] += 1
                        self._warn_env_error(f"{where}: environment '{self.env_config['environment']}' failed to open "
                                        f"the episode: {type(exc).__name__}: {exc}", None)
                        _close(env)
                        continue
                else:
                    opening = row_messages(row, where)
                    prompt_ids, vision = self._opening_ids(opening, cache, where)
                episodes.append(_Episode(index, sample, env, [dict(m) for m in opening], prompt_ids, vision=vision))
        return episodes

    def _opening_ids(self, messages: list[dict], cache: dict, where: str) -> tuple[list[int], dict | None]:
        if image_parts(messages):  # not cached: images are not text to key on (and rarely repeat across rows)
            return self.renderer.opening(messages, where)
        key = json.dumps(messages, sort_keys=True)
        if key not in cache:
            cache[key] = self.renderer.opening_ids(messages)
        return list(cache[key]), None

    def _advance(self, episode: _Episode, completion, limit: int, stats: dict) -> None:
        """Append one generated turn to ``episode`` and answer it (tools, environment, or the end)."""
        ids, logprobs, finish = list(completion.token_ids), list(completion.logprobs), completion.finish_reason
        if not ids:  # every turn needs a token to carry its reward and to keep the response ending on the policy's
            raise RuntimeError(f"multi_turn: rollout engine {type(self.engine).__name__} returned an empty completion "
                               f"(max_new_tokens={limit} >= 1); an engine must generate at least one token")
        if len(ids) > limit:  # one engine call serves every episode: cut this one to its own budget
            ids, logprobs, finish = ids[:limit], logprobs[:limit], "length"
        episode.response_ids += ids
        episode.mask += [1] * len(ids)
        episode.logprobs += logprobs
        episode.turns += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        episode.last_text = text
        episode.messages.append({"role": "assistant", "content": text})
        _, calls, parse_error = self.parser.parse(text)
        turn = AssistantTurn(text=text, tool_calls=calls, parse_error=parse_error, token_ids=ids,
                             finish_reason=finish, index=episode.turns - 1)
        if self.tools and (calls or parse_error):
            observation = self._call_tools(episode, turn)
        elif episode.env is not None:
            try:
                result = check_step_result(episode.env.step(turn), f"environment '{self.env_config['environment']}'")
            except Exception as exc:
                self._fail(episode, exc, stats)
                return
            episode.turn_rewards.append((len(episode.response_ids) - 1, float(result.reward)))
            if result.info:
                episode.env_infos.append(result.info)
            observation = result.observation
            if result.done:
                episode.stop_reason = "done"
        else:
            episode.stop_reason = "answered"
        if len(episode.response_ids) >= self.max_total_tokens and not episode.done:
            episode.stop_reason = "max_total_tokens"
        if not episode.done and episode.turns >= self.max_turns:
            episode.stop_reason = "max_turns"
        if not episode.done:
            try:
                delta, shown = self.renderer.delta(episode.messages, observation, ids, finish,
                                                   f"multi_turn: row {episode.row_index}'s observation")
            except ValueError as exc:
                if not image_parts(observation):  # a template that cannot be continued: the run's problem
                    raise
                self._fail(episode, exc, stats)  # an image the policy cannot see, or one that does not decode
                return
            if len(episode.response_ids) + len(delta) >= self.max_total_tokens:  # no room left for a turn
                episode.stop_reason = "max_total_tokens"
            else:
                episode.messages.extend(dict(m) for m in observation)
                episode.vision = join_images(episode.vision, shown)
                episode.response_ids += delta
                episode.mask += [0] * len(delta)
                episode.logprobs += [0.0] * len(delta)
        if episode.done:
            if episode.env is not None:
                _close(episode.env)

    def _call_tools(self, episode: _Episode, turn: AssistantTurn) -> list[dict]:
        """One ``tool`` message per call (result or error), plus one for a parse error."""
        messages = []
        for call in turn.tool_calls:
            episode.tool_calls += 1
            tool = self.tools.get(call.name)
            if tool is None:
                content = (f"error: unknown tool '{call.name}'. Available tools: "
                           f"{', '.join(sorted(self.tools))}")
                episode.tool_errors += 1
            else:
                try:
                    content = tool(**call.arguments)
                except Exception as exc:  # the model's call failed: it sees why, training goes on
                    content = f"error: {type(exc).__name__}: {exc}"
                    episode.tool_errors += 1
            messages.append({"role": "tool", "content": content, "name": call.name, "tool_call_id": call.id})
        if turn.parse_error is not None:
            episode.tool_errors += 1
            episode.parse_errors += 1
            messages.append({"role": "tool", "content": f"error: {turn.parse_error}", "name": "tool_parser",
                             "tool_call_id": f"call_{len(turn.tool_calls)}"})
        return messages

    def _fail(self, episode: _Episode, exc: Exception, stats: dict) -> None:
        stats["env_errors"] += 1
        self._warn_env_error(f"environment '{self.env_config['environment']}' raised in step() on row "
                        f"{episode.row_index}: {type(exc).__name__}: {exc}", self.fallback)
        episode.env_error = f"{type(exc).__name__}: {exc}"
        episode.stop_reason = "env_error"
        episode.turn_rewards = []  # the episode gets the fallback score as a whole
        _close(episode.env)

    def _warn_env_error(self, message: str, fallback: float | None) -> None:
        """Warn about the first environment error of this workflow; later ones are only counted."""
        if self._warned_env:
            return
        self._warned_env = True
        outcome = ("the episode is dropped" if fallback is None
                   else f"the episode ends with the fallback score {fallback} (reward.fallback)")
        warnings.warn(f"multi_turn: {message}; {outcome} and training continues. Further environment errors are "
                      f"counted in rollout/env_errors without a warning.", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ scoring and experiences

    def _score(self, rows: list[dict], episodes: list[_Episode]) -> list[tuple[float, dict, float]]:
        """``(score, details, reward_fn_score)`` per episode; the reward function runs once for the step."""
        scored_episodes = [e for e in episodes if e.env_error is None]
        prompts = [self._prompt_text(rows[e.row_index], e) for e in scored_episodes]
        results = iter(score_responses(self.reward, [rows[e.row_index] for e in scored_episodes],
                                       [e.last_text for e in scored_episodes], prompts, "multi_turn"))
        names = list(getattr(self.reward, "names", []) or [])
        out = []
        for episode in episodes:
            if episode.env_error is not None:
                out.append((self.fallback, {name: self.fallback for name in names}, self.fallback))
                continue
            score, details = next(results)
            out.append((sum(r for _, r in episode.turn_rewards) + score, details, score))
        return out

    def _prompt_text(self, row: dict, episode: _Episode) -> str:
        if isinstance(row.get("prompt"), str):
            return row["prompt"]
        opening = episode.messages[: len(episode.messages) - _transcript_tail(episode.messages)]
        return render_text(self.tokenizer, opening, tools=self.renderer.tools)

    def _experience(self, row: dict, episode: _Episode, score: float, details: dict, reward_fn_score: float,
                    group_id: int, baseline: float | None) -> Experience:
        env_reward = sum(r for _, r in episode.turn_rewards)
        info = {
            "prompt": row.get("prompt", ""),
            "response": episode.last_text,
            "ground_truth": row.get("ground_truth", ""),
            "row_id": row.get("id", str(episode.row_index)),
            "sample_index": episode.sample_index,
            "messages": transcript_record(episode.messages),  # images as thumbnails: the record stays JSON
            "turns": episode.turns,
            "tool_calls": episode.tool_calls,
            "tool_errors": episode.tool_errors,
            "tool_parse_errors": episode.parse_errors,
            "truncated": episode.truncated,
            "stop_reason": episode.stop_reason,
            "env_reward": env_reward,
            "reward_fn_score": reward_fn_score,
        }
        if episode.env_error is not None:
            info["env_error"] = episode.env_error
        if episode.env_infos:
            info["env_info"] = episode.env_infos
        if episode.vision is not None:
            info["images_shown"] = image_count(episode.vision)
        return Experience(
            prompt_ids=list(episode.prompt_ids), response_ids=list(episode.response_ids), score=score,
            group_id=group_id, response_mask=list(episode.mask), rollout_logprobs=list(episode.logprobs),
            finish_reason="length" if episode.truncated else "stop", reward_details=details, info=info,
            baseline_score=baseline, turn_rewards=list(episode.turn_rewards) or None, vision=episode.vision,
        )


def _transcript_tail(messages: list[dict]) -> int:
    """How many messages from the first assistant turn on (the opening is what comes before)."""
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            return len(messages) - index
    return 0


def _close(env: Environment | None) -> None:
    if env is None:
        return
    try:
        env.close()
    except Exception:  # a failing close must not end training; the episode's outcome is already decided
        pass


def _env_config(env: Mapping[str, Any] | None, sampling: SamplingParams) -> dict[str, Any]:
    """The ``env`` section with defaults filled in; a bad value is a ``ValueError`` naming ``env.<key>``."""
    env = dict(env or {})
    unknown = sorted(set(env) - set(ENV_DEFAULTS))
    if unknown:
        raise ValueError(f"multi_turn: unknown key(s) {['env.' + k for k in unknown]}; "
                         f"valid: {', '.join('env.' + k for k in ENV_DEFAULTS)}")
    cfg = {**ENV_DEFAULTS, **env}
    if cfg["max_new_tokens_per_turn"] is None:
        cfg["max_new_tokens_per_turn"] = sampling.max_new_tokens
    for key in ("max_turns", "max_new_tokens_per_turn", "max_total_tokens"):
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"multi_turn: env.{key} must be an integer >= 1, got {value!r}")
    if not isinstance(cfg["tools"], (list, tuple)) or not all(isinstance(t, str) for t in cfg["tools"]):
        raise ValueError(f"multi_turn: env.tools must be a list of tool names, got {cfg['tools']!r}")
    for key in ("environment_args", "tools_args", "mcp_servers", "tool_parser_args"):
        if not isinstance(cfg[key] or {}, Mapping):
            raise ValueError(f"multi_turn: env.{key} must be a mapping, got {cfg[key]!r}")
        cfg[key] = dict(cfg[key] or {})
    extra = sorted(set(cfg["tools_args"]) - set(cfg["tools"]))
    if extra:
        raise ValueError(f"multi_turn: env.tools_args.{extra[0]}: '{extra[0]}' is not selected in env.tools "
                         f"(selected: {', '.join(cfg['tools']) or '(none)'})")
    return cfg


def _metrics(experiences: list[Experience], stats: dict, generate_s: float, reward_s: float) -> dict[str, float]:
    metrics: dict[str, float] = {
        "time/generate_s": generate_s,
        "time/env_s": stats["env_s"],
        "time/reward_s": reward_s,
        "rollout/engine_calls": float(stats["engine_calls"]),
        "rollout/env_errors": float(stats["env_errors"]),
    }
    if not experiences:
        return metrics
    count = len(experiences)
    lengths = [len(e.response_ids) for e in experiences]
    policy_tokens = [sum(e.response_mask) for e in experiences]
    metrics.update({
        "rollout/response_length_mean": sum(lengths) / count,
        "rollout/response_length_max": float(max(lengths)),
        "rollout/generated_tokens": float(sum(policy_tokens)),
        "rollout/observation_tokens_mean": (sum(lengths) - sum(policy_tokens)) / count,
        "rollout/truncated_fraction": sum(e.info["truncated"] for e in experiences) / count,
        "rollout/turns_mean": sum(e.info["turns"] for e in experiences) / count,
        "rollout/tool_calls": sum(e.info["tool_calls"] for e in experiences) / count,
        "rollout/tool_errors": sum(e.info["tool_errors"] for e in experiences) / count,
        "rollout/tool_parse_errors": float(sum(e.info["tool_parse_errors"] for e in experiences)),
        "rollout/env_reward_mean": sum(e.info["env_reward"] for e in experiences) / count,
        "rollout/reward_fn_mean": sum(e.info["reward_fn_score"] for e in experiences) / count,
    })
    for name in sorted({name for e in experiences for name in e.reward_details}):
        values = [e.reward_details[name] for e in experiences if name in e.reward_details]
        metrics[f"reward/{name}"] = sum(values) / len(values)
    return metrics


@rltk.hookimpl
def rltk_workflows():
    return {"multi_turn": MultiTurnWorkflow}
