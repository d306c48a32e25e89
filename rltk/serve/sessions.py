"""What the endpoint served, token for token, and how a session becomes trajectories.

Every choice the endpoint returns is a :class:`Record`: the exact prompt ids the
engine received, the completion ids it produced (cut where the response was cut,
e.g. at a stop string) and their log-probs, filed under the request's session id
in a :class:`SessionStore`.

Stitching (:func:`stitch`). An agent talking to the endpoint re-sends the whole
conversation each turn, so turn ``k``'s prompt usually *extends* turn ``k-1``'s
prompt + completion: the earlier ids, then the tokens the chat template or the
agent inserted (the end of the assistant turn, a tool result, the next user
message), then the new generation prompt. Records are taken in the order the
engine produced them; each one is attached to the trajectory whose ids so far
are the longest prefix of its prompt ids:

* the inserted tokens ``prompt[len(ids):]`` join the response with
  ``response_mask`` 0 (log-prob 0: the policy did not sample them), the
  completion joins with mask 1 and its log-probs;
* if that prefix is an *earlier* state of a trajectory that has grown since
  (the agent branched: the other ``n`` choices of one request, or a retry from
  an earlier turn), the trajectory is forked at that state, so each branch is
  its own trajectory with the shared history;
* if no trajectory's ids are a prefix of the prompt (the agent rewrote history:
  summarised earlier turns, dropped a tool result, or a template re-rendered an
  earlier turn to different tokens), the record starts a **new segment**: a new
  trajectory whose prompt is the whole prompt. Every segment becomes its own
  experience in the episode's group; nothing is re-tokenized to force a match,
  because re-tokenized ids are not the ids the log-probs belong to.

Nothing here imports the web stack: the workflow and the tests use it directly.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_SESSION = "default"


@dataclass(frozen=True)
class Record:
    """One choice the endpoint returned, exactly as the engine saw and produced it.

    ``seq`` orders records across the whole store (the order the engine's
    results were recorded in); ``request_id`` and ``index`` name the response
    and the choice within it.
    """

    session_id: str
    request_id: str
    index: int
    seq: int
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    text: str
    endpoint: str  # "chat" or "completions"
    # Tool use, for the agentic workflow's metrics: calls parsed from this completion (a request with
    # ``tools``; 0 when the text failed to parse, ``tool_parse_error`` then), and the ``tool`` messages the
    # request sent back after its last assistant message, ``tool_result_errors`` of them starting "error".
    tool_calls: int = 0
    tool_parse_error: bool = False
    tool_results: int = 0
    tool_result_errors: int = 0

    def to_dict(self) -> dict:
        """JSON-ready form (lists for the id tuples)."""
        return {
            "session_id": self.session_id, "request_id": self.request_id, "index": self.index, "seq": self.seq,
            "prompt_ids": list(self.prompt_ids), "completion_ids": list(self.completion_ids),
            "logprobs": list(self.logprobs), "finish_reason": self.finish_reason, "text": self.text,
            "endpoint": self.endpoint, "tool_calls": self.tool_calls, "tool_parse_error": self.tool_parse_error,
            "tool_results": self.tool_results, "tool_result_errors": self.tool_result_errors,
        }


class SessionStore:
    """Thread-safe ``session id -> [Record]``, in the order records were added.

    Args:
        max_sessions: keep at most this many sessions, dropping the least
            recently written (a long-lived ``rltk serve`` would otherwise grow
            without bound); ``None`` keeps all (training pops each episode's
            session as soon as it is stitched).
    """

    def __init__(self, max_sessions: int | None = None):
        if max_sessions is not None and (not isinstance(max_sessions, int) or max_sessions < 1):
            raise ValueError(f"SessionStore: max_sessions must be an integer >= 1 or None, got {max_sessions!r}")
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, list[Record]] = OrderedDict()
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def add(self, session_id: str, request_id: str, index: int, prompt_ids, completion_ids, logprobs,
            finish_reason: str, text: str, endpoint: str, **tool_use: int | bool) -> Record:
        """File one choice under ``session_id`` and return its :class:`Record` (``tool_use``: its tool fields)."""
        with self._lock:
            record = Record(session_id, request_id, index, next(self._seq), tuple(prompt_ids),
                            tuple(completion_ids), tuple(float(x) for x in logprobs), finish_reason, text, endpoint,
                            **tool_use)
            records = self._sessions.setdefault(session_id, [])
            records.append(record)
            self._sessions.move_to_end(session_id)
            if self.max_sessions is not None:
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            return record

    def get(self, session_id: str) -> list[Record]:
        """A copy of the session's records (``[]`` for a session never seen)."""
        with self._lock:
            return list(self._sessions.get(session_id, ()))

    def requests(self, session_id: str) -> int:
        """How many requests (not choices) the session made so far."""
        with self._lock:
            return len({r.request_id for r in self._sessions.get(session_id, ())})

    def pop(self, session_id: str) -> list[Record]:
        """Remove the session and return its records (``[]`` if none)."""
        with self._lock:
            return self._sessions.pop(session_id, [])

    def session_ids(self) -> list[str]:
        """Every session held, least recently written first."""
        with self._lock:
            return list(self._sessions)


def tool_results_sent(messages: list[dict]) -> tuple[int, int]:
    """``(results, errors)``: the ``tool`` messages after the last assistant message (what this request sends
    back for the previous turn's calls), and how many of them start with ``"error"`` (the convention of
    :func:`rltk.workflows.agents.run_tool_calls` and the ``multi_turn`` workflow for a failed call)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    results = [m for m in messages[last + 1:] if m.get("role") == "tool"]
    errors = sum(isinstance(m.get("content"), str) and m["content"].lstrip().lower().startswith("error")
                 for m in results)
    return len(results), errors


@dataclass
class Trajectory:
    """A session's stitched token stream: one experience's worth.

    ``response_ids`` hold every token after ``prompt_ids``: completions (mask 1,
    their sampled log-probs) and the tokens inserted between them (mask 0,
    log-prob 0). ``records`` are the ``seq`` numbers of the records merged in.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    records: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    last_text: str = ""

    @property
    def ids(self) -> list[int]:
        """Prompt and response ids together: what the next turn's prompt must start with to extend it."""
        return self.prompt_ids + self.response_ids

    def extend(self, record: Record) -> None:
        """Append the tokens ``record``'s prompt inserted (mask 0) and its completion (mask 1)."""
        inserted = list(record.prompt_ids[len(self.prompt_ids) + len(self.response_ids):])
        self.response_ids += inserted + list(record.completion_ids)
        self.response_mask += [0] * len(inserted) + [1] * len(record.completion_ids)
        self.logprobs += [0.0] * len(inserted) + list(record.logprobs)
        self.records.append(record.seq)
        self.finish_reason = record.finish_reason
        self.last_text = record.text

    def truncated_copy(self, response_len: int, records: int) -> "Trajectory":
        """This trajectory as it was when its response was ``response_len`` tokens (a fork point)."""
        return Trajectory(list(self.prompt_ids), self.response_ids[:response_len],
                          self.response_mask[:response_len], self.logprobs[:response_len],
                          self.records[:records], self.finish_reason, self.last_text)


def stitch(records: list[Record]) -> list[Trajectory]:
    """Assemble one session's records into trajectories by token prefix (see the module docstring).

    Returns the trajectories in the order they were started. A session with
    one linear conversation gives exactly one trajectory whose ``ids`` equal
    the last record's prompt + completion.
    """
    trajectories: list[Trajectory] = []
    # Every state a trajectory has passed through: (trajectory index, response length, records, ids).
    states: list[tuple[int, int, int, tuple[int, ...]]] = []
    finish_states: list[tuple[str, str]] = []  # finish reason and text at each state, for forks
    for record in sorted(records, key=lambda r: r.seq):
        prompt = record.prompt_ids
        best = None
        for number, (t_index, length, count, ids) in enumerate(states):
            if len(ids) <= len(prompt) and prompt[: len(ids)] == ids:
                if best is None or len(ids) >= len(states[best][3]):  # longest prefix; the latest on a tie
                    best = number
        if best is None:
            trajectory = Trajectory(list(prompt))
            trajectories.append(trajectory)
            t_index = len(trajectories) - 1
        else:
            t_index, length, count, _ = states[best]
            trajectory = trajectories[t_index]
            if len(trajectory.response_ids) != length or len(trajectory.records) != count:
                trajectory = trajectory.truncated_copy(length, count)  # a branch from an earlier state
                trajectory.finish_reason, trajectory.last_text = finish_states[best]
                trajectories.append(trajectory)
                t_index = len(trajectories) - 1
        trajectory.extend(record)
        states.append((t_index, len(trajectory.response_ids), len(trajectory.records), tuple(trajectory.ids)))
        finish_states.append((trajectory.finish_reason, trajectory.last_text))
    return trajectories
