"""Workflow ``verifiers``: an installed `verifiers` environment's own rollout and rubric, on the policy.

::

    rltk run grpo rollout.workflow=verifiers rollout.workflow_args.env_id=my_env \\
        rollout.workflow_args.env_args.difficulty=easy data.task=verifiers data.task_args.env_id=my_env

The environment (any ``load_environment()`` module: ``SingleTurnEnv``,
``MultiTurnEnv``, ``ToolEnv``, ... see :mod:`rltk.environments.verifiers_envs`)
runs its rollout loop unchanged. Its model client is an ``openai.AsyncOpenAI``
client of an OpenAI-compatible endpoint that rltk serves *in this process*
from the training rollout engine, exactly as for the ``agentic`` workflow
(:mod:`rltk.workflows.agentic`, whose endpoint, batching, turn caps and
sampling rules this workflow shares): every episode's client sends its own
session id (header ``X-Session-Id``), the endpoint records each request's
exact prompt ids, completion ids and log-probs, and after the step each
session is stitched by token prefix into trajectories (the environment's own
messages, tool results among them, with ``response_mask`` 0). No token the
policy sampled is ever re-tokenized.

Rewards. Each row's ``n`` episodes are scored together by the environment's
rubric (``rubric.score_group``, so group-level reward functions see the whole
group): the weighted sum (``state["reward"]``) is the experience's score, and
every reward function's and metric's own value (``state["metrics"]``) goes into
``reward_details``, logged as ``reward/<name>``. The ``gdpo`` advantage reads one
column per reward function of the rubric (weight not 0), in the rubric's order.

Rows. A row from the data task ``verifiers`` carries the environment's dataset
row in ``extras["verifiers"]``, handed to the rollout unchanged. Any other row
becomes ``{"prompt": its messages (or prompt as a user message), "answer":
ground_truth, "info": extras}`` (without ``extras["task"]``, which verifiers
would read as a task to route to), so rltk's own tasks and data files can be
played by an environment too.

Failures. An episode whose rollout raises, ends with ``state["error"]`` set, or
runs past ``episode_timeout_s`` is dropped and counted (``agentic/agent_errors``,
the first error logged once per step); a step whose every episode failed is an
error naming the first failure. The whole step waits at most
``step_timeout_s`` (default: enough rounds of ``episode_timeout_s`` for all the
episodes at ``concurrency``, plus ``scoring_timeout_s``) and then says what it
was waiting for.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import rltk
from rltk.environments.verifiers_envs import import_verifiers, load_verifiers_env
from rltk.errors import ConfigError
from rltk.rollout.base import RolloutEngine, SamplingParams
from rltk.workflows.agentic import AgenticWorkflow

logger = logging.getLogger(__name__)


class RubricReward:
    """The run's ``reward`` as this workflow exposes it: ``names`` are the rubric's reward functions (gdpo's
    columns, in the rubric's order); counters and checkpoint state are the configured composer's, which is never
    called, because the environment's rubric scores every episode."""

    def __init__(self, names: list[str], composer: Any = None):
        self.names = list(names)
        self.composer = composer

    def __call__(self, **_):
        raise RuntimeError("verifiers: the environment's rubric scores the episodes; reward.reward_fn is not called")

    def stats(self) -> dict[str, float]:
        return self.composer.stats() if hasattr(self.composer, "stats") else {}

    def __getattr__(self, name: str):  # reset_stats, state_dict, load_state_dict ... of the composer
        composer = self.__dict__.get("composer")
        if composer is None:
            raise AttributeError(name)
        return getattr(composer, name)


def rubric_reward_names(rubric: Any) -> list[str]:
    """Names of the rubric's reward functions (weight not 0), in its order; metrics (weight 0) left out."""
    rubrics = getattr(rubric, "rubrics", None)  # a RubricGroup scores with each of its rubrics in turn
    if isinstance(rubrics, list):
        names: list[str] = []
        for inner in rubrics:
            names += [n for n in rubric_reward_names(inner) if n not in names]
        return names
    return [getattr(f, "__name__", repr(f)) for f, w in zip(rubric.funcs, rubric.weights) if w != 0]


class VerifiersWorkflow(AgenticWorkflow):
    """Rows -> ``n`` episodes each of a verifiers environment over the OpenAI endpoint -> stitched, rubric-scored
    experiences (registered ``verifiers``).

    Args (``rollout.workflow_args.*``):
        env_id: the installed environment (a module with ``load_environment``; ``owner/name`` Hub ids
            load the module ``name``).
        env_args: keyword arguments of its ``load_environment()``.
        sampling_args: extra sampling arguments the environment passes on every request (``max_tokens``
            defaults to ``env.max_new_tokens_per_turn``); the endpoint still forces the rollout's
            temperature, top-p and top-k in training unless ``force_sampling=false``.
        episode_timeout_s: the longest one episode (its whole rollout) may take.
        scoring_timeout_s: the longest the rubric may take on one row's group.
        step_timeout_s: the longest a whole step may take (``None``: derived, see the module docstring).
        concurrency, batch_window_s, max_batch, batch_max_wait_s, request_timeout_s, force_sampling,
            model_name, host: the endpoint's, as for ``agentic``.

    ``env`` (the recipe's section): ``max_new_tokens_per_turn``, ``max_turns`` (requests one episode
    may make), ``tool_parser`` (+ ``_args``) as for ``agentic``. The environment's own ``max_turns``
    still ends its loop first when smaller.
    """

    workflow_name = "verifiers"
    component_args: dict = {}

    def __init__(
        self,
        *, engine: RolloutEngine, tokenizer: Any, reward: Any, sampling: SamplingParams,
        env_id: str | None = None,
        env_args: Mapping[str, Any] | None = None,
        sampling_args: Mapping[str, Any] | None = None,
        env: Mapping[str, Any] | None = None,
        episode_timeout_s: float = 600.0,
        scoring_timeout_s: float = 600.0,
        step_timeout_s: float | None = None,
        # the endpoint's, handed to AgenticWorkflow (see its docstring)
        concurrency: int = 32, batch_window_s: float = 0.05, max_batch: int = 64,
        batch_max_wait_s: float | None = None, request_timeout_s: float = 600.0, force_sampling: bool = True,
        model_name: str = "policy", host: str = "127.0.0.1",
    ):
        self.vf = import_verifiers()
        self.env_id = env_id
        self.vf_env = load_verifiers_env(env_id, env_args, key="rollout.workflow_args.env_id",
                                         args_key="rollout.workflow_args.env_args")
        if sampling_args is not None and not isinstance(sampling_args, Mapping):
            raise ConfigError(f"'rollout.workflow_args.sampling_args' must be a mapping, got {sampling_args!r}")
        for key, value in (("episode_timeout_s", episode_timeout_s), ("scoring_timeout_s", scoring_timeout_s),
                           ("step_timeout_s", step_timeout_s)):
            if value is None and key == "step_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"'rollout.workflow_args.{key}' must be a number of seconds > 0, got {value!r}")
        # the endpoint, its batching and turn caps as AgenticWorkflow's; the environment is the "agent"
        super().__init__(engine=engine, tokenizer=tokenizer, sampling=sampling, env=env,
                         reward=RubricReward(rubric_reward_names(self.vf_env.rubric), reward),
                         agent=f"verifiers environment {env_id!r}",
                         concurrency=concurrency, batch_window_s=batch_window_s, max_batch=max_batch,
                         batch_max_wait_s=batch_max_wait_s, request_timeout_s=request_timeout_s,
                         force_sampling=force_sampling, model_name=model_name, host=host)
        self.sampling_args = {"max_tokens": self.max_tokens_per_request, **dict(sampling_args or {})}
        self.episode_timeout_s = float(episode_timeout_s)
        self.scoring_timeout_s = float(scoring_timeout_s)
        self.step_timeout_s = step_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._async_client = None

    def _bind_agent(self, agent: str, agent_args: Mapping[str, Any] | None, env: dict) -> None:
        # the environment runs its own rollout loop, with its own tools: no registered agent, nothing to bind
        self.agent, self.agent_args, self.tools, self.agent_takes_tools = agent, {}, [], False

    # ------------------------------------------------------------------ the event loop the environment runs in

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """One event loop in a thread of its own for the workflow's life: the environment's async objects
        (its rubric's, its clients') stay on the loop that made them, across steps."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="rltk-verifiers-loop", daemon=True)
            thread.start()
            self._loop, self._loop_thread = loop, thread
        return self._loop

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            client, self._async_client = self._async_client, None
            if client is not None:
                try:
                    asyncio.run_coroutine_threadsafe(client.close(), loop).result(timeout=10)
                except Exception:  # closing is best effort: the loop and its sockets go away next
                    pass
            loop.call_soon_threadsafe(loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=10)
            loop.close()
        super().close()

    def _step_timeout(self, episodes: int) -> float:
        if self.step_timeout_s is not None:
            return float(self.step_timeout_s)
        rounds = math.ceil(episodes / self.concurrency)
        return rounds * self.episode_timeout_s + self.scoring_timeout_s + 60.0

    # ------------------------------------------------------------------ episodes

    def _vf_input(self, row: Mapping, row_index: int) -> dict:
        """The environment's rollout input for ``row`` (its own dataset row when the row came from it)."""
        import copy

        extras = row.get("extras") or {}
        if isinstance(extras, Mapping) and isinstance(extras.get("verifiers"), Mapping):
            given = copy.deepcopy(dict(extras["verifiers"]))
        else:
            messages = row.get("messages")
            if not messages:
                messages = [{"role": "user", "content": row.get("prompt", "")}]
            # verifiers reads info["task"] as a task payload to route; rltk's extras["task"] only names the
            # synthetic task the row came from, so it stays out
            info = {k: v for k, v in extras.items() if k != "task"} if isinstance(extras, Mapping) else {}
            given = {"prompt": [dict(m) for m in messages], "answer": row.get("ground_truth", ""),
                     "info": copy.deepcopy(info)}
        given.setdefault("example_id", row_index)
        given.setdefault("answer", row.get("ground_truth", ""))
        return given

    def _run_episodes(self, rows: list[dict], n: int, override: dict | None) -> list[dict]:
        with self._episodes(rows, n, override) as (batcher, episodes):
            batcher.expect(min(self.concurrency, len(episodes)) or 1)
            timeout = self._step_timeout(len(episodes))
            future = asyncio.run_coroutine_threadsafe(self._play_all(rows, episodes, batcher), self._ensure_loop())
            try:
                future.result(timeout=timeout)
            except TimeoutError:
                future.cancel()
                raise TimeoutError(
                    f"verifiers: the step's {len(episodes)} episodes of environment {self.env_id!r} did not finish "
                    f"in {timeout:.0f} s (rollout.workflow_args.step_timeout_s; each episode may take "
                    f"episode_timeout_s={self.episode_timeout_s:g} s, each group's scoring "
                    f"scoring_timeout_s={self.scoring_timeout_s:g} s)") from None
        return episodes

    async def _play_all(self, rows: list[dict], episodes: list[dict], batcher) -> None:
        import openai
        from verifiers.legacy.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

        if self._async_client is None:
            self._async_client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self._api_key, max_retries=0,
                                                    timeout=self.request_timeout_s)
        gate = asyncio.Semaphore(self.concurrency)
        unfinished = [len(episodes)]
        inputs = [self._vf_input(row, index) for index, row in enumerate(rows)]

        async def play(episode: dict) -> None:
            async with gate:
                client = OpenAIChatCompletionsClient(
                    self._async_client.with_options(default_headers={"X-Session-Id": episode["session_id"]}))
                try:
                    episode["state"] = await asyncio.wait_for(
                        self.vf_env.rollout(dict(inputs[episode["row_index"]]), client, self.model_name,
                                            dict(self.sampling_args)),
                        timeout=self.episode_timeout_s)
                    error = episode["state"].get("error")
                    if error is not None:
                        episode["error"] = f"the environment's rollout ended with an error: {error!r}"
                except asyncio.TimeoutError:
                    episode["error"] = (f"TimeoutError: the rollout did not finish in {self.episode_timeout_s:g} s "
                                        f"(rollout.workflow_args.episode_timeout_s)")
                except Exception as exc:  # the episode is dropped and counted; training goes on
                    episode["error"] = f"{type(exc).__name__}: {exc}"
                finally:
                    unfinished[0] -= 1
                    batcher.expect(min(self.concurrency, unfinished[0]) or None)
            if episode["error"] is not None:
                episode["traceback"] = episode["error"]

        await asyncio.gather(*(play(e) for e in episodes))
        groups: dict[int, list[dict]] = {}
        for episode in episodes:
            if episode["error"] is None:
                groups.setdefault(episode["row_index"], []).append(episode)
        for group in groups.values():
            states = [e["state"] for e in group]
            try:
                await asyncio.wait_for(self.vf_env.rubric.score_group(states), timeout=self.scoring_timeout_s)
            except asyncio.TimeoutError:
                for e in group:
                    e["error"] = (f"TimeoutError: the rubric did not score the group in {self.scoring_timeout_s:g} s "
                                  f"(rollout.workflow_args.scoring_timeout_s)")
                continue
            except Exception as exc:
                for e in group:
                    e["error"] = f"the rubric raised: {type(exc).__name__}: {exc}"
                continue
            for e in group:
                try:
                    await self.vf_env.rubric.cleanup(e["state"])
                except Exception as exc:  # cleanup is the rubric's business; the scores stand
                    logger.warning("verifiers: the rubric's cleanup raised: %s: %s", type(exc).__name__, exc)
        for episode in episodes:
            if episode["error"] is not None:
                episode["traceback"] = episode["error"]

    def _scores(self, rows: list[dict], episodes: list[dict]) -> None:
        """``score``: the rubric's weighted reward; ``details``: each reward function's and metric's value."""
        for episode in episodes:
            if episode["error"] is not None or not episode["records"]:
                continue
            state = episode["state"]
            reward = state.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                episode["error"] = f"the rubric gave no finite reward (state['reward'] = {reward!r})"
                episode["traceback"] = episode["error"]
                continue
            metrics = state.get("metrics") or {}
            episode["score"] = float(reward)
            episode["details"] = {str(k): float(v) for k, v in metrics.items()
                                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
            episode["agent_info"] = {"turns": float(len(state.get("trajectory") or []))}

    def _check_openings(self, rows: list[dict], episodes: list[dict]) -> float:
        # The environment builds its own opening (its system prompt, few-shot, tools); rows from the
        # `verifiers` task carry that same opening as `messages`, so the check stays meaningful for them only.
        checked = [e for e in episodes if isinstance((rows[e["row_index"]].get("extras") or {}).get("verifiers"),
                                                        Mapping)]
        if not checked:
            return 0.0
        return super()._check_openings(rows, checked)

    def run(self, rows: list[dict]):
        started = time.perf_counter()
        experiences = super().run(rows)
        self._metrics["time/verifiers_step_s"] = time.perf_counter() - started
        return experiences


@rltk.hookimpl
def rltk_workflows():
    return {"verifiers": VerifiersWorkflow}
