"""Workflow ``agentic``: your agent code drives the policy through an OpenAI-compatible endpoint.

The loop is the agent's, not rltk's. For every row, ``sampling.n`` episodes run
the registered agent (kind ``agent``, :mod:`rltk.workflows.agents`)::

    def my_agent(row: dict, client: openai.OpenAI, model: str, *, tools, **agent_args)
        -> float | None | tuple[float | None, dict]

with a client whose requests go to an endpoint rltk serves *in this process*
(uvicorn in a background thread, :mod:`rltk.serve.app`) from the training
rollout engine, and carry the episode's session id (header ``X-Session-Id``).
Episodes run concurrently in a thread pool, so the endpoint's batcher turns
their requests into batched engine calls, as a batched single-turn rollout
would be.

Trajectories. The endpoint records each request's exact prompt ids,
completion ids and log-probs; after the step each session is stitched by
token prefix (:func:`rltk.serve.sessions.stitch`): a request whose prompt
extends an earlier prompt + completion continues that trajectory, the inserted
tokens (chat-template glue, tool results, user turns) with ``response_mask`` 0
and the completion with mask 1 and its log-probs. A request that does *not*
extend any earlier one (the agent rewrote history) starts a new **segment**:
one more experience in the episode's group, with the same score. So a
multi-turn agent on a template that re-renders earlier turns to the same ids
gives one experience per episode; every policy token is trained exactly once
either way, and no token is ever re-tokenized.

Rewards. The agent's return value is the episode's score; ``None`` means "score
the final answer": the reward function gets the row's prompt, ground truth
and extras and the text of the session's last completion. A pair ``(score or
None, {name: number})`` adds the agent's own numbers, logged as
``agent/<name>`` (means over the episodes that report them). An agent that
raises (or returns anything else) drops its episode, counted in
``agentic/agent_errors``; a step in which every episode failed is an error
naming the first failure.

Tools. ``env.tools`` (with ``env.tools_args``) are the agent's tools: an agent
that names a ``tools`` parameter gets them, bound and in that order, offers
them with ``tools=[t.schema() for t in tools]`` and runs the calls with
:func:`rltk.workflows.agents.run_tool_calls`. The supervised warm-up renders
the same list into its prompts and demonstrations, so the prompt trained on is
the prompt served. Each step checks that: an episode whose first request is
not the row's prompt as the warm-up rendered it (other tools, none, another
system prompt) counts in ``agentic/opening_mismatch``, and the first one is
reported with the place the two texts part. The endpoint parses each
completion of a request with ``tools`` (``env.tool_parser``) and counts, per
episode: ``rollout/tool_calls`` (calls it returned), ``rollout/tool_parse_errors``
(completions that tried to call and did not parse), ``rollout/tool_results``
(``tool`` messages the agent sent back) and ``rollout/tool_errors`` (parse
errors plus results that start with ``"error"``, as :func:`run_tool_calls`
writes for a failed call).

Sampling. During training the endpoint forces the rollout's temperature,
top-p and top-k on every request (the trainer's log-prob recompute assumes
that distribution; ``force_sampling=false`` serves requests as asked, for
agents that know what they do); :meth:`AgenticWorkflow.evaluate` forces
greedy decoding.

The ``env`` section, where it applies: ``env.max_new_tokens_per_turn`` is the
most ``max_tokens`` one request may ask for (and the default when it asks for
none); ``env.max_turns`` the most requests one episode may make (the next one
gets a 400 error, code ``max_turns_exceeded``, which the agent sees as
``openai.BadRequestError``); ``env.tool_parser`` (+ ``_args``) parses tool calls
of requests with ``tools``; ``env.tools`` (+ ``_args``) are the agent's tools
(above). ``env.environment`` and ``env.max_total_tokens`` belong to ``multi_turn``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import inspect
import logging
import math
import secrets
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import rltk
from rltk.batch import Experience
from rltk.errors import ConfigError
from rltk.rollout.base import RolloutEngine, SamplingParams
from rltk.tools.resolve import resolve_tools
from rltk.workflows.base import (
    GroupNumbering, Workflow, check_rows, check_workflow_parts, held_out_metrics, reward_means, score_samples,
)

logger = logging.getLogger(__name__)


def _positive_int(value: Any, key: str, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"agentic: {key} must be an integer >= 1{' or null' if allow_none else ''}, got {value!r}")


class AgenticWorkflow(GroupNumbering, Workflow):
    """Rows -> ``n`` agent episodes each over the OpenAI endpoint -> stitched experiences (registered ``agentic``).

    Args (``rollout.workflow_args.*``):
        agent: a registered agent name (kind ``agent``; ``rltk list agent``).
        agent_args: keyword arguments for the agent, beside the row, client and model.
        env: the ``env`` config section (given by the recipe; see the module docstring);
            ``None`` (direct construction) means no turn cap, ``hermes`` and
            ``sampling.max_new_tokens`` per request.
        concurrency: episodes running at once (threads); the endpoint batches their requests.
        batch_window_s, max_batch: the endpoint batcher's wait for more requests after
            the latest one, and its cap on sequences per engine call.
        batch_max_wait_s: the longest one batch waits for the running episodes' requests.
            The workflow tells the batcher how many episodes are running, so a batch goes
            out as soon as each has its request in; until then it waits (not for a
            ``batch_window_s`` gap: episodes answered together ask again spread over a few
            hundred ms when they are many threads), at most this long (an agent that
            works between requests, e.g. runs a tool, holds the others' batch that long);
            ``None``: 1 s, or ``batch_window_s`` when that is longer.
        request_timeout_s: the client's timeout per request.
        force_sampling: serve every training request with the rollout's temperature,
            top-p and top-k, whatever the agent asked (see the module docstring).
        model_name: the model id the agent is given and must pass.
        host: where the in-process endpoint listens (a free port is chosen).

    The endpoint starts on the first :meth:`run` or :meth:`evaluate` and stops
    at :meth:`close` (or at interpreter exit).
    """

    workflow_name = "agentic"

    #: ``rollout.workflow_args.agent`` names a component of kind ``agent`` (its arguments in ``agent_args``),
    #: checked by ``rltk validate`` before anything is built.
    component_args = {"agent": "agent"}

    def __init__(
        self,
        *, engine: RolloutEngine, tokenizer: Any, reward: Any, sampling: SamplingParams,
        agent: str,
        agent_args: Mapping[str, Any] | None = None,
        env: Mapping[str, Any] | None = None,
        concurrency: int = 32,
        batch_window_s: float = 0.05,
        max_batch: int = 64,
        batch_max_wait_s: float | None = None,
        request_timeout_s: float = 600.0,
        force_sampling: bool = True,
        model_name: str = "policy",
        host: str = "127.0.0.1",
    ):
        check_workflow_parts(self.workflow_name, sampling, reward)
        env = dict(env or {})
        self._bind_agent(agent, agent_args, env)
        _positive_int(concurrency, "rollout.workflow_args.concurrency")
        _positive_int(max_batch, "rollout.workflow_args.max_batch")
        _positive_int(env.get("max_new_tokens_per_turn"), "env.max_new_tokens_per_turn", allow_none=True)
        _positive_int(env.get("max_turns"), "env.max_turns", allow_none=True)
        if batch_max_wait_s is None and isinstance(batch_window_s, (int, float)):
            batch_max_wait_s = max(1.0, batch_window_s)
        if isinstance(batch_max_wait_s, bool) or not isinstance(batch_max_wait_s, (int, float)) \
                or not batch_max_wait_s >= batch_window_s:
            raise ConfigError(f"'rollout.workflow_args.batch_max_wait_s' must be a number of seconds >= "
                              f"batch_window_s ({batch_window_s}), got {batch_max_wait_s!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward = reward
        self.sampling = sampling
        self.concurrency = concurrency
        self.max_tokens_per_request = env.get("max_new_tokens_per_turn") or sampling.max_new_tokens
        self.max_turns = env.get("max_turns")
        self.tool_parser = env.get("tool_parser") or "hermes"
        self.tool_parser_args = dict(env.get("tool_parser_args") or {})
        self.batch_window_s = batch_window_s
        self.max_batch = max_batch
        self.batch_max_wait_s = float(batch_max_wait_s)
        self.request_timeout_s = request_timeout_s
        self.force_sampling = force_sampling
        self.model_name = model_name
        self.host = host
        self._server = None
        self._api_key = secrets.token_urlsafe(24)
        self._client = None
        self._free_clients: list = []  # idle per-episode clients, kept across steps (their connections stay open)
        self._clients_lock = threading.Lock()
        self._next_group_id = 0
        self._metrics: dict[str, float] = {}
        self._warned_opening = False

    def _bind_agent(self, agent: str, agent_args: Mapping[str, Any] | None, env: dict) -> None:
        """The registered agent the episodes run, its arguments and its tools (``env.tools``), checked."""
        if not isinstance(agent, str):
            raise ValueError(f"agentic: rollout.workflow_args.agent must name a registered agent, got {agent!r}")
        self.agent_fn = rltk.get_component("agent", agent)  # an unknown name lists the registered agents
        if agent_args is not None and not isinstance(agent_args, Mapping):
            raise ValueError(f"agentic: rollout.workflow_args.agent_args must be a mapping, got {agent_args!r}")
        self.tools = _agent_tools(env)
        self.agent_takes_tools = "tools" in _parameters(self.agent_fn)
        if self.agent_takes_tools and "tools" in (agent_args or {}):
            raise ValueError(f"agentic: rollout.workflow_args.agent_args.tools: agent {agent!r} gets its tools from "
                             f"env.tools (the warm-up renders the same list); name them there")
        if self.agent_takes_tools and not self.tools:
            raise ValueError(f"agentic: agent {agent!r} offers the tools it is given, and env.tools is empty; list "
                             f"them in env.tools (e.g. env.tools=[calculator]), which the warm-up renders too")
        self.agent = agent
        self.agent_args = dict(agent_args or {})

    # ------------------------------------------------------------------ the endpoint

    @property
    def base_url(self) -> str:
        """The endpoint's ``.../v1`` URL (starts it if needed)."""
        self._ensure_server()
        return self._server.base_url

    @property
    def app_state(self):
        """The endpoint's :class:`rltk.serve.app.ServeState` (store, batcher, counters); starts it if needed."""
        self._ensure_server()
        return self._server.app.state.rltk

    def _ensure_server(self) -> None:
        if self._server is not None:
            return
        from rltk.serve import require_serve_dependencies

        require_serve_dependencies("fastapi", "uvicorn", "openai", feature="the agentic workflow")
        import openai

        from rltk.serve.app import BackgroundServer, create_app
        from rltk.serve.sessions import SessionStore

        defaults = replace(self.sampling, n=1, seed=None,
                           max_new_tokens=min(self.sampling.max_new_tokens, self.max_tokens_per_request))
        app = create_app(
            self.engine, self.tokenizer, model_name=self.model_name, defaults=defaults,
            max_tokens_limit=self.max_tokens_per_request, max_model_len=_max_model_len(self.engine),
            tool_parser=self.tool_parser, tool_parser_args=self.tool_parser_args, store=SessionStore(),
            window_s=self.batch_window_s, max_batch=self.max_batch, max_wait_s=self.batch_max_wait_s,
            max_requests_per_session=self.max_turns,
            api_keys=[self._api_key],  # only this process's agents may generate or read its sessions
        )
        server = BackgroundServer(app, host=self.host)
        server.start()
        self._server = server
        self._client = self._new_client()
        atexit.register(self.close)

    def _new_client(self):
        """An ``openai.OpenAI`` client of the endpoint with its own HTTP connection pool (one connection in use, normally).

        Each running episode borrows one (:meth:`_borrow_client`): a client shared by all
        ``concurrency`` threads scans its whole connection pool on every request and keeps
        only 100 idle connections (openai's default), so above that episodes reconnect each
        turn. ``TCP_NODELAY`` because the client writes headers and body separately and
        Nagle's algorithm would hold the body for the server's delayed ACK (~40 ms a request).
        """
        import socket

        import openai

        httpx = importlib.import_module(_httpx_module(openai.DefaultHttpxClient))
        # no cap on connections: an agent may send requests from several threads of its own at once
        transport = httpx.HTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=2),
                                        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        http_client = openai.DefaultHttpxClient(transport=transport, timeout=self.request_timeout_s)
        return openai.OpenAI(base_url=self._server.base_url, api_key=self._api_key, max_retries=0,
                             timeout=self.request_timeout_s, http_client=http_client)

    def _borrow_client(self):
        with self._clients_lock:
            if self._free_clients:
                return self._free_clients.pop()
        return self._new_client()

    def _return_client(self, client) -> None:
        with self._clients_lock:
            self._free_clients.append(client)

    def close(self) -> None:
        """Stop the endpoint (idempotent); the next :meth:`run` starts a new one."""
        server, self._server = self._server, None
        if self._client is not None:
            self._client.close()
            self._client = None
        with self._clients_lock:
            clients, self._free_clients = self._free_clients, []
        for client in clients:
            client.close()
        if server is not None:
            server.stop()

    # ------------------------------------------------------------------ episodes

    @contextlib.contextmanager
    def _episodes(self, rows: list[dict], n: int, override: dict | None) -> Iterator[tuple[Any, list[dict]]]:
        """The endpoint's batcher (the endpoint started if need be) and one dict per episode to come, ``n`` per
        row with a session id each, while they run: the endpoint serves them with ``override``. When they have
        run, each dict holds its session's ``records``."""
        self._ensure_server()
        state = self._server.app.state.rltk
        state.sampling_override = override
        prefix = uuid.uuid4().hex[:12]
        episodes = [{"row_index": r, "sample_index": s, "session_id": f"{prefix}-{r}-{s}", "result": None,
                     "agent_info": {}, "error": None} for r in range(len(rows)) for s in range(n)]
        try:
            yield state.batcher, episodes
        finally:
            state.sampling_override = None
            state.batcher.expect(None)
        for episode in episodes:
            episode["records"] = state.store.pop(episode["session_id"])

    def _run_episodes(self, rows: list[dict], n: int, override: dict | None) -> list[dict]:
        """Run ``n`` episodes of every row; one dict per episode with its result, error and records."""
        with self._episodes(rows, n, override) as (batcher, episodes):
            # Episodes running now, each waiting on at most one request: the batcher sends a round as soon as it
            # holds a request from each of them instead of waiting out its window (the agents are all blocked then).
            workers = min(self.concurrency, len(episodes)) or 1
            unfinished = [len(episodes)]
            lock = threading.Lock()

            def play(episode: dict) -> None:
                try:
                    _play(episode)
                finally:
                    with lock:
                        unfinished[0] -= 1
                        batcher.expect(min(workers, unfinished[0]))

            def _play(episode: dict) -> None:
                own = self._borrow_client()
                client = own.with_options(default_headers={"X-Session-Id": episode["session_id"]})
                row = rows[episode["row_index"]]
                tools = {"tools": list(self.tools)} if self.agent_takes_tools else {}
                try:
                    result = self.agent_fn(row=_copy_row(row), client=client, model=self.model_name, **tools,
                                           **self.agent_args)
                    episode["result"], episode["agent_info"] = _agent_result(self.agent, result)
                except Exception as exc:  # the episode is dropped and counted; training goes on
                    episode["error"] = f"{type(exc).__name__}: {exc}"
                    episode["traceback"] = traceback.format_exc()
                finally:
                    self._return_client(own)

            batcher.expect(min(workers, len(episodes)))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rltk-agent") as pool:
                list(pool.map(play, episodes))
        return episodes

    def _scores(self, rows: list[dict], episodes: list[dict]) -> None:
        """Fill ``episode["score"]`` and ``["details"]``: the agent's float, or the reward on the final text."""
        to_score = [e for e in episodes if e["error"] is None and e["records"] and e["result"] is None]
        samples, wheres = [], []
        for episode in to_score:
            row = rows[episode["row_index"]]
            final = max(episode["records"], key=lambda r: r.seq)
            samples.append({"prompt": _prompt_text(row), "response": final.text,
                            "ground_truth": row.get("ground_truth", ""), "extras": dict(row.get("extras") or {})})
            wheres.append(f"row {episode['row_index']} (id {row.get('id', str(episode['row_index']))!r}), "
                          f"episode {episode['sample_index']}")
        for episode, (score, details) in zip(to_score, score_samples(self.reward, samples, wheres, "agentic")):
            episode["score"], episode["details"] = score, details
        for episode in episodes:
            if episode["error"] is None and episode["records"] and episode["result"] is not None:
                episode["score"], episode["details"] = episode["result"], {"agent": episode["result"]}

    # ------------------------------------------------------------------ training rollouts

    def run(self, rows: list[dict]) -> list[Experience]:
        """``sampling.n`` episodes per row, stitched into experiences; all of a row's share one group id.

        Rows are dicts as the agent expects them (``prompt`` and/or ``messages``,
        ``ground_truth``, ``extras``, ``id``); the agent gets a copy of its row.
        """
        from rltk.serve.sessions import stitch

        rows = check_rows(rows, "agentic", prompt_required=False)
        if not rows:
            self._metrics = {}
            return []
        calls_before = self.app_state.batcher.stats()
        override = None
        if self.force_sampling:
            override = {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                        "top_k": self.sampling.top_k, "greedy": self.sampling.greedy}
        tick = time.perf_counter()
        episodes = self._run_episodes(rows, self.sampling.n, override)
        generate_s = time.perf_counter() - tick
        calls_after = self.app_state.batcher.stats()

        tick = time.perf_counter()
        self._scores(rows, episodes)
        experiences: list[Experience] = []
        group_ids = []
        for _ in rows:
            group_ids.append(self.new_group_id())
        errors = [e for e in episodes if e["error"] is not None]
        empty = [e for e in episodes if e["error"] is None and not e["records"]]
        segments, requests = [], []
        mismatched = self._check_openings(rows, episodes)
        for episode in episodes:
            if "score" not in episode:
                continue
            row_index = episode["row_index"]
            row = rows[row_index]
            trajectories = stitch(episode["records"])
            segments.append(len(trajectories))
            requests.append(len(episode["records"]))
            tool_use = _tool_use(episode["records"])
            for segment, trajectory in enumerate(trajectories):
                experiences.append(Experience(
                    prompt_ids=trajectory.prompt_ids,
                    response_ids=trajectory.response_ids,
                    response_mask=trajectory.response_mask,
                    rollout_logprobs=trajectory.logprobs,
                    score=episode["score"],
                    group_id=group_ids[row_index],
                    finish_reason=trajectory.finish_reason,
                    reward_details=dict(episode["details"]),
                    info={"prompt": _prompt_text(row), "response": trajectory.last_text,
                          "ground_truth": row.get("ground_truth", ""), "row_id": row.get("id", str(row_index)),
                          "sample_index": episode["sample_index"], "session_id": episode["session_id"],
                          "segment": segment, "segments": len(trajectories),
                          "requests": len(trajectory.records),
                          # the names multi_turn uses: assistant turns in this trajectory, cut at a limit
                          "turns": len(trajectory.records), "truncated": trajectory.finish_reason == "length",
                          **tool_use, "agent_info": dict(episode["agent_info"])},
                ))
        if not experiences:
            first = (errors or empty or [None])[0]
            why = (f"the first agent error was:\n{first['traceback']}" if first is not None and first["error"]
                   else "no agent sent a single request to the endpoint")
            raise RuntimeError(f"{self.workflow_name}: all {len(episodes)} episodes of agent {self.agent!r} failed or "
                               f"made no request, so there is nothing to train on; {why}")
        if errors:  # counted in the metrics; the first message says why, once per step
            logger.warning("%s: %d of %d episodes dropped because agent %r failed; the first: %s", self.workflow_name,
                           len(errors), len(episodes), self.agent, errors[0]["error"])
        reward_s = time.perf_counter() - tick
        self._metrics = _metrics(experiences, episodes, errors, empty, segments, requests, generate_s, reward_s,
                                 calls_before, calls_after)
        self._metrics["agentic/opening_mismatch"] = mismatched
        return experiences

    def _check_openings(self, rows: list[dict], episodes: list[dict]) -> float:
        """The fraction of episodes whose first request is not the row's prompt as the warm-up rendered it.

        A row formatted with the chat template (it has ``messages``) carries its opening rendered
        with ``env.tools`` as ``prompt``: what the supervised warm-up put before each demonstration.
        An agent that opens otherwise (other or no ``tools=``, another system prompt, its own
        wording) is served a prompt the warm-up never showed, and a warm-up with a low loss can
        then leave the policy at zero reward. The first such episode is reported once, with the
        place the two texts part; the metric counts them every step.
        """
        checked = mismatched = 0
        expected: dict[int, list[int]] = {}
        for episode in episodes:
            row = rows[episode["row_index"]]
            if not episode["records"] or not isinstance(row.get("prompt"), str) or not row.get("messages"):
                continue
            index = episode["row_index"]
            if index not in expected:
                expected[index] = list(self.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
            first = min(episode["records"], key=lambda r: r.seq)
            checked += 1
            if list(first.prompt_ids) == expected[index]:
                continue
            mismatched += 1
            if not self._warned_opening:
                self._warned_opening = True
                logger.warning("agentic: %s", _opening_difference(self.tokenizer, self.agent, row, expected[index],
                                                                   list(first.prompt_ids), self.tools))
        return mismatched / checked if checked else 0.0

    def metrics(self) -> dict[str, float]:
        """About the last :meth:`run`: ``agentic/episodes``, ``agentic/agent_errors`` (episodes dropped
        because the agent raised or returned a bad value), ``agentic/empty_episodes`` (no request made),
        ``agentic/segments_per_episode``, ``agentic/requests_per_episode``, ``agentic/engine_calls``,
        ``agentic/requests_per_engine_call``, ``time/generate_s``, ``time/reward_s``,
        ``rollout/response_length_mean|max``, ``rollout/policy_tokens``, ``rollout/truncated_fraction``,
        ``rollout/turns_mean`` (requests stitched into each experience), ``rollout/tool_calls``,
        ``rollout/tool_results`` and ``rollout/tool_errors`` (per episode), ``rollout/tool_parse_errors``
        (count), ``rollout/tool_call_fraction`` (episodes with a call), ``agentic/opening_mismatch`` (see
        the module docstring), ``agent/<name>`` (what agents returned beside their reward),
        ``reward/<name>``."""
        return dict(self._metrics)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, rows: list[dict], params: SamplingParams | None = None, *,
                 threshold: float = 1.0) -> dict[str, float]:
        """One episode per held-out row, greedy by default (``params`` forces its sampling on every request).

        Returns ``accuracy`` (episodes scoring ``>= threshold``; a failed episode
        counts as unsolved), ``mean_score``, ``mean_response_length`` (policy
        tokens per episode), ``truncated_fraction`` (episodes whose last
        completion hit its length limit), ``tool_calls`` (per episode),
        ``agent_errors`` and ``num_responses``.
        """
        rows = check_rows(rows, "agentic", prompt_required=False)
        if not rows:
            raise ValueError("agentic.evaluate() got no rows; give it the held-out split")
        params = params or replace(self.sampling, n=1, greedy=True)
        override = {"greedy": True} if params.greedy else {
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "greedy": False}
        episodes = self._run_episodes(rows, 1, override)
        self._scores(rows, episodes)
        scores, lengths, truncated, tool_calls = [], [], 0, 0
        for episode in episodes:
            scores.append(episode.get("score", 0.0))
            lengths.append(sum(len(r.completion_ids) for r in episode["records"]))
            tool_calls += _tool_use(episode["records"])["tool_calls"]
            if episode["records"]:
                truncated += max(episode["records"], key=lambda r: r.seq).finish_reason == "length"
        return {**held_out_metrics(scores, lengths, truncated, threshold), "tool_calls": tool_calls / len(episodes),
                "agent_errors": float(sum(e["error"] is not None for e in episodes))}


def _copy_row(row: Mapping) -> dict:
    """A copy an agent may edit without changing the row its sibling episodes get."""
    import copy

    return copy.deepcopy(dict(row))


def _prompt_text(row: Mapping) -> str:
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    messages = row.get("messages") or []
    users = [m.get("content", "") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else ""


def _httpx_module(client_class: type) -> str:
    """The HTTP library ``openai`` is built on (``httpx``, or ``httpx2`` in later releases): its client's base."""
    for base in client_class.__mro__[1:]:
        if base.__name__ == "Client":
            return base.__module__.split(".")[0]
    return "httpx"


def _max_model_len(engine: RolloutEngine) -> int | None:
    """The served model's context length (``max_position_embeddings``), when the engine exposes its model."""
    model = getattr(engine, "model", None)
    while model is not None and hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def _metrics(experiences, episodes, errors, empty, segments, requests, generate_s, reward_s,
             calls_before, calls_after) -> dict[str, float]:
    lengths = [len(e.response_ids) for e in experiences]
    policy_tokens = sum(sum(e.response_mask) for e in experiences)
    calls = calls_after["engine_calls"] - calls_before["engine_calls"]
    jobs = calls_after["jobs"] - calls_before["jobs"]
    metrics = {
        "time/generate_s": generate_s,
        "time/reward_s": reward_s,
        "agentic/episodes": float(len(episodes)),
        "agentic/agent_errors": float(len(errors)),
        "agentic/empty_episodes": float(len(empty)),
        "agentic/segments_per_episode": sum(segments) / len(segments),
        "agentic/requests_per_episode": sum(requests) / len(requests),
        "agentic/engine_calls": float(calls),
        "agentic/requests_per_engine_call": jobs / calls if calls else 0.0,
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": float(max(lengths)),
        "rollout/policy_tokens": float(policy_tokens),
        "rollout/truncated_fraction": sum(e.finish_reason == "length" for e in experiences) / len(experiences),
        "rollout/turns_mean": sum(e.info["turns"] for e in experiences) / len(experiences),
    }
    played = [e for e in episodes if "score" in e]  # the episodes trained on, one entry each (not per segment)
    uses = [_tool_use(e["records"]) for e in played]
    metrics.update({
        "rollout/tool_calls": sum(u["tool_calls"] for u in uses) / len(uses),
        "rollout/tool_results": sum(u["tool_results"] for u in uses) / len(uses),
        "rollout/tool_errors": sum(u["tool_errors"] for u in uses) / len(uses),
        "rollout/tool_parse_errors": float(sum(u["tool_parse_errors"] for u in uses)),
        "rollout/tool_call_fraction": sum(u["tool_calls"] > 0 for u in uses) / len(uses),
    })
    for name in sorted({name for e in played for name in e["agent_info"]}):
        values = [e["agent_info"][name] for e in played if name in e["agent_info"]]
        metrics[f"agent/{name}"] = sum(values) / len(values)
    return {**metrics, **reward_means(experiences)}


def _tool_use(records: list) -> dict[str, int]:
    """An episode's tool use, from the endpoint's records (see :class:`rltk.serve.sessions.Record`)."""
    calls = sum(r.tool_calls for r in records)
    parse_errors = sum(bool(r.tool_parse_error) for r in records)
    # every choice of a request carries that request's results: count each request once
    first_choices = [r for r in records if r.index == 0]
    results = sum(r.tool_results for r in first_choices)
    result_errors = sum(r.tool_result_errors for r in first_choices)
    return {"tool_calls": calls, "tool_results": results, "tool_parse_errors": parse_errors,
            "tool_errors": parse_errors + result_errors}


def _agent_tools(env: Mapping[str, Any]) -> list:
    """The tools of ``env.tools``, bound with ``env.tools_args``, in that order (what the warm-up renders)."""
    return resolve_tools(env)


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _agent_result(agent: str, result: Any) -> tuple[float | None, dict[str, float]]:
    """An agent's return value as ``(score or None, {name: number})``; ``TypeError`` naming what is valid."""
    info: Any = {}
    if isinstance(result, tuple) and len(result) == 2:
        result, info = result
        if not isinstance(info, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for k, v in info.items()):
            raise TypeError(f"agent {agent!r} returned ({result!r}, {info!r}); the second item of a pair is a dict "
                            "of finite numbers by name, logged as agent/<name>")
    if result is not None and (isinstance(result, bool) or not isinstance(result, (int, float))
                               or not math.isfinite(result)):
        raise TypeError(f"agent {agent!r} returned {result!r}; an agent returns the episode's reward as a finite "
                        "float, or None to let the reward function score the final answer (either one may come "
                        "as a pair with a dict of numbers to log)")
    return (None if result is None else float(result)), {k: float(v) for k, v in info.items()}


def _opening_difference(tokenizer: Any, agent: str, row: Mapping, expected: list[int], served: list[int],
                        tools: list) -> str:
    """Why an episode's first request is not the warm-up's prompt: where the texts part, and what to check."""
    common = 0
    while common < min(len(expected), len(served)) and expected[common] == served[common]:
        common += 1
    trained, sent = tokenizer.decode(expected[common:]), tokenizer.decode(served[common:])
    offered = ", ".join(t.name for t in tools) or "none"
    return (f"the first request of agent {agent!r} on row {row.get('id', '?')!r} is not the prompt the warm-up "
            f"trained on: they part at token {common}, where the warm-up's prompt goes on {trained[:80]!r} and "
            f"the request {sent[:80]!r}. The warm-up renders the row's messages with env.tools ({offered}); an "
            f"agent should open with those messages (rltk.workflows.chat.row_messages(row)) and offer exactly "
            f"tools=[t.schema() for t in tools]. Episodes that differ are counted in agentic/opening_mismatch")


@rltk.hookimpl
def rltk_workflows():
    return {"agentic": AgenticWorkflow}
