"""Environment ``openenv``: an OpenEnv environment server, played through OpenEnv's own client.

OpenEnv (``pip install openenv``; the ``openenv`` extra) serves an environment
over HTTP/WebSocket (``create_app(...)`` under uvicorn, a container, a Hugging
Face Space). This environment is the client side for the ``multi_turn``
workflow: each episode opens its own session on the server with OpenEnv's
``GenericEnvClient`` (one WebSocket, so the server keeps one environment
instance per episode), calls ``reset`` once and ``step`` once per assistant
turn, and closes the session when the episode ends::

    env.environment=openenv env.environment_args.url=http://127.0.0.1:8000
    env.environment_args.action_field=message env.environment_args.observation_field=text

Mapping between the two contracts:

* The opening (``opening``): ``"row"`` the dataset row's messages,
  ``"observation"`` the reset observation as a user message, ``"row+observation"``
  (default) both, the observation after the row's messages (left out when it
  renders to an empty text).
* ``reset`` gets ``reset_args`` plus the row's ``extras`` named in
  ``reset_from_extras`` (e.g. ``[seed]`` for a per-row seed).
* Each assistant turn becomes the action ``{action_field: text}`` (plus the
  fixed ``action_args``); the step's observation comes back as one user
  message: its ``observation_field``, or, with none set, the observation as
  JSON (its ``reward``/``done``/``metadata`` left out).
* The step's ``reward`` (``None`` counts 0) is the turn's reward; ``done`` ends
  the episode; ``metadata`` is kept in ``Experience.info["env_info"]``.

Timeouts. Opening a session waits ``connect_timeout_s``; each ``reset``/``step``
answer ``message_timeout_s``. A server that does not answer in time fails that
episode with an error naming the URL and what was waited for (``multi_turn``
counts it in ``rollout/env_errors``). Before the first episode the workflow
calls :meth:`OpenEnv.check_args`: bad arguments and a server that does not
answer ``GET <url>/health`` stop the run with an error naming the key (exit 2).

Concurrency. All episodes of a step are open at once (``multi_turn`` steps them
together), so the server must accept that many sessions (OpenEnv's
``max_concurrent_envs``, and ``SUPPORTS_CONCURRENT_SESSIONS = True`` on its
environment class); a refused session fails its episode with the server's message.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import rltk
from rltk.environments.base import AssistantTurn, Environment, StepResult
from rltk.errors import ConfigError

_OPENINGS = ("row", "observation", "row+observation")
_KEY = "env.environment_args"


def _require_openenv():
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as exc:
        raise ConfigError(f"env.environment=openenv needs the OpenEnv client, which is not installed ({exc}); "
                          f"pip install 'rltk[openenv]' (or openenv>=0.10)") from None
    return GenericEnvClient


def _positive_seconds(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{_KEY}.{key} must be a positive number of seconds, got {value!r}")
    return float(value)


class OpenEnv(Environment):
    """One episode = one session on an OpenEnv server (registered ``openenv``; see the module docstring).

    Args:
        url: the server's base URL (``http://host:port``; ``ws://`` also works).
        action_field: the action's field that carries the assistant turn's text.
        action_args: fixed fields added to every action.
        observation_field: the observation's field shown to the policy; ``None``:
            the whole observation as JSON.
        opening: ``"row"``, ``"observation"`` or ``"row+observation"``.
        reset_args: keyword arguments of every ``reset``.
        reset_from_extras: names of the row's ``extras`` passed to ``reset`` too.
        connect_timeout_s: the longest wait to open a session.
        message_timeout_s: the longest wait for one ``reset``/``step`` answer.
    """

    def __init__(self, *, url: str, action_field: str = "message", action_args: Mapping[str, Any] | None = None,
                 observation_field: str | None = None, opening: str = "row+observation",
                 reset_args: Mapping[str, Any] | None = None, reset_from_extras: Sequence[str] | None = None,
                 connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0):
        self.check_args(url=url, action_field=action_field, action_args=action_args,
                        observation_field=observation_field, opening=opening, reset_args=reset_args,
                        reset_from_extras=reset_from_extras, connect_timeout_s=connect_timeout_s,
                        message_timeout_s=message_timeout_s, probe=False)
        self.url = url.rstrip("/")
        self.action_field = action_field
        self.action_args = dict(action_args or {})
        self.observation_field = observation_field
        self.opening = opening
        self.reset_args = dict(reset_args or {})
        self.reset_from_extras = list(reset_from_extras or [])
        self.connect_timeout_s = float(connect_timeout_s)
        self.message_timeout_s = float(message_timeout_s)
        client_cls = _require_openenv()
        self._client = client_cls(base_url=self.url, connect_timeout_s=self.connect_timeout_s,
                                  message_timeout_s=self.message_timeout_s).sync()

    @classmethod
    def check_args(cls, *, url: Any = None, action_field: Any = "message", action_args: Any = None,
                   observation_field: Any = None, opening: Any = "row+observation", reset_args: Any = None,
                   reset_from_extras: Any = None, connect_timeout_s: Any = 10.0, message_timeout_s: Any = 60.0,
                   probe: bool = True) -> None:
        """Raise :class:`~rltk.errors.ConfigError` naming the ``env.environment_args`` key of a bad value.

        With ``probe`` (the ``multi_turn`` workflow's check before its first
        episode), also ``GET <url>/health``, waiting ``connect_timeout_s``: a
        server that is down or does not answer stops the run here, not episode by episode.
        """
        if not isinstance(url, str) or not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ConfigError(f"{_KEY}.url must be the OpenEnv server's address (http://host:port), got {url!r}")
        if not isinstance(action_field, str) or not action_field:
            raise ConfigError(f"{_KEY}.action_field must name the action's text field, got {action_field!r}")
        if observation_field is not None and (not isinstance(observation_field, str) or not observation_field):
            raise ConfigError(f"{_KEY}.observation_field must name an observation field or be null, "
                              f"got {observation_field!r}")
        for key, value in (("action_args", action_args), ("reset_args", reset_args)):
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"{_KEY}.{key} must be a mapping, got {value!r}")
        if opening not in _OPENINGS:
            raise ConfigError(f"{_KEY}.opening must be one of {', '.join(_OPENINGS)}, got {opening!r}")
        if reset_from_extras is not None and (isinstance(reset_from_extras, str) or not isinstance(
                reset_from_extras, Sequence) or not all(isinstance(k, str) for k in reset_from_extras)):
            raise ConfigError(f"{_KEY}.reset_from_extras must be a list of names of the row's extras, "
                              f"got {reset_from_extras!r}")
        connect = _positive_seconds(connect_timeout_s, "connect_timeout_s")
        _positive_seconds(message_timeout_s, "message_timeout_s")
        if probe:
            _require_openenv()
            _probe_health(url, connect)

    # ------------------------------------------------------------------ the episode

    def reset(self, row: dict) -> list[dict]:
        extras = row.get("extras") or {}
        missing = [k for k in self.reset_from_extras if k not in extras]
        if missing:
            raise KeyError(f"openenv: {_KEY}.reset_from_extras names {missing}, which row "
                           f"{row.get('id', '?')!r} has not in its extras (it has {sorted(extras)})")
        kwargs = {**self.reset_args, **{k: extras[k] for k in self.reset_from_extras}}
        result = self._call("reset", lambda: self._client.reset(**kwargs))
        messages = []
        if self.opening != "observation":
            if row.get("messages"):
                messages += [dict(m) for m in row["messages"]]
            elif isinstance(row.get("prompt"), str):
                messages.append({"role": "user", "content": row["prompt"]})
            else:
                raise KeyError(f"openenv: {_KEY}.opening={self.opening!r} opens with the row's messages, and row "
                               f"{row.get('id', '?')!r} has neither 'messages' nor a text 'prompt'")
        if self.opening != "row":
            text = self._observation_text(result.observation)
            if text or not messages:
                messages.append({"role": "user", "content": text})
        return messages

    def step(self, turn: AssistantTurn) -> StepResult:
        action = {**self.action_args, self.action_field: turn.text}
        result = self._call("step", lambda: self._client.step(action))
        reward = 0.0 if result.reward is None else float(result.reward)
        info = {"metadata": result.metadata} if result.metadata else {}
        observation = [] if result.done else [{"role": "user", "content": self._observation_text(result.observation)}]
        return StepResult(observation=observation, reward=reward, done=bool(result.done), info=info)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    # ------------------------------------------------------------------ helpers

    def _call(self, what: str, fn):
        """Run one client call; a timeout or a refused connection becomes an error naming the server and the wait."""
        try:
            return fn()
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise TimeoutError(f"openenv: the environment server at {self.url} did not answer {what} within "
                               f"{self.message_timeout_s:g} s ({_KEY}.message_timeout_s)") from exc
        except ConnectionError as exc:
            raise ConnectionError(f"openenv: could not open a session on the environment server at {self.url} "
                                  f"within {self.connect_timeout_s:g} s ({_KEY}.url, {_KEY}.connect_timeout_s): "
                                  f"{exc}") from exc

    def _observation_text(self, observation: Any) -> str:
        if not isinstance(observation, Mapping):
            return "" if observation is None else str(observation)
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise KeyError(f"openenv: the observation has no field {self.observation_field!r} "
                               f"({_KEY}.observation_field); it has {sorted(observation)}")
            value = observation[self.observation_field]
            return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        rest = {k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")}
        return json.dumps(rest, sort_keys=True) if rest else ""


def _probe_health(url: str, timeout_s: float) -> None:
    import urllib.error
    import urllib.request

    health = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout_s) as response:  # noqa: S310 (the configured server)
            response.read()
    except urllib.error.HTTPError as exc:
        raise ConfigError(f"{_KEY}.url: the OpenEnv server at {url} answered GET /health with HTTP {exc.code}; "
                          f"is it an OpenEnv server?") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ConfigError(f"{_KEY}.url: no OpenEnv server answered GET {health} within {timeout_s:g} s "
                          f"({_KEY}.connect_timeout_s): {reason}. Start the server first") from None


@rltk.hookimpl
def rltk_environments():
    return {"openenv": OpenEnv}
