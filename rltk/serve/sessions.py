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
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

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

    def to_dict(self) -> dict:
        """JSON-ready form (lists for the id tuples)."""
        return {
            "session_id": self.session_id, "request_id": self.request_id, "index": self.index, "seq": self.seq,
            "prompt_ids": list(self.prompt_ids), "completion_ids": list(self.completion_ids),
            "logprobs": list(self.logprobs), "finish_reason": self.finish_reason, "text": self.text,
            "endpoint": self.endpoint,
        }


class SessionStore:
    """Thread-safe ``(owner, session id) -> [Record]``, in the order records were added, bounded everywhere.

    ``owner`` is the caller's namespace (:func:`rltk.serve.auth.owner_tag`: ``None`` unless the
    endpoint has several API keys), so one key never reads or extends another key's session.

    Args:
        max_sessions: keep at most this many sessions, dropping the least recently written;
            ``None``: no cap on the count (the byte cap still holds).
        max_records: records kept per session; the oldest go first (``default``, the session of
            requests without ``X-Session-Id``, is not exempt).
        max_bytes: estimated bytes kept per session (:func:`record_bytes`), oldest records first;
            the newest record is always kept, so a session may exceed it by one record.
        max_total_bytes: estimated bytes over all sessions; the least recently written sessions
            go first.

    A session's request count (:meth:`requests`, the endpoint's ``max_turns`` cap) includes
    requests whose records were evicted; :meth:`evicted` counts the records dropped.
    """

    def __init__(self, max_sessions: int | None = None, *, max_records: int | None = 4096,
                 max_bytes: int | None = 64 << 20, max_total_bytes: int | None = 512 << 20):
        for name, value in (("max_sessions", max_sessions), ("max_records", max_records),
                            ("max_bytes", max_bytes), ("max_total_bytes", max_total_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"SessionStore: {name} must be an integer >= 1 or None, got {value!r}")
        self.max_sessions, self.max_records = max_sessions, max_records
        self.max_bytes, self.max_total_bytes = max_bytes, max_total_bytes
        self._sessions: OrderedDict[tuple, _Session] = OrderedDict()
        self._total_bytes = 0
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def add(self, session_id: str, request_id: str, index: int, prompt_ids, completion_ids, logprobs,
            finish_reason: str, text: str, endpoint: str, *, owner: str | None = None) -> Record:
        """File one choice under ``(owner, session_id)`` and return its :class:`Record`."""
        record = Record(session_id, request_id, index, 0, tuple(prompt_ids), tuple(completion_ids),
                        tuple(float(x) for x in logprobs), finish_reason, text, endpoint)
        size = record_bytes(record)
        with self._lock:
            record = replace(record, seq=next(self._seq))
            key = (owner, session_id)
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = _Session()
            self._sessions.move_to_end(key)
            session.records.append((record, size))
            session.bytes += size
            self._total_bytes += size
            session.live[request_id] = session.live.get(request_id, 0) + 1
            while len(session.records) > 1 and (
                    (self.max_records is not None and len(session.records) > self.max_records)
                    or (self.max_bytes is not None and session.bytes > self.max_bytes)):
                self._drop_oldest(session)
            while len(self._sessions) > 1 and (
                    (self.max_sessions is not None and len(self._sessions) > self.max_sessions)
                    or (self.max_total_bytes is not None and self._total_bytes > self.max_total_bytes)):
                _, dropped = self._sessions.popitem(last=False)
                self._total_bytes -= dropped.bytes
            return record

    def _drop_oldest(self, session: "_Session") -> None:
        old, old_size = session.records.popleft()
        session.bytes -= old_size
        self._total_bytes -= old_size
        session.evicted += 1
        session.live[old.request_id] -= 1
        if not session.live[old.request_id]:
            del session.live[old.request_id]
            session.evicted_requests += 1

    def get(self, session_id: str, owner: str | None = None) -> list[Record]:
        """A copy of the session's records (``[]`` for a session never seen, or another owner's)."""
        with self._lock:
            session = self._sessions.get((owner, session_id))
            return [r for r, _ in session.records] if session is not None else []

    def requests(self, session_id: str, owner: str | None = None) -> int:
        """How many requests (not choices) the session made so far, evicted ones included."""
        with self._lock:
            session = self._sessions.get((owner, session_id))
            return len(session.live) + session.evicted_requests if session is not None else 0

    def evicted(self, session_id: str, owner: str | None = None) -> int:
        """How many of the session's records were dropped to keep it within its bounds."""
        with self._lock:
            session = self._sessions.get((owner, session_id))
            return session.evicted if session is not None else 0

    def pop(self, session_id: str, owner: str | None = None) -> list[Record]:
        """Remove the session and return its records (``[]`` if none)."""
        with self._lock:
            session = self._sessions.pop((owner, session_id), None)
            if session is None:
                return []
            self._total_bytes -= session.bytes
            return [r for r, _ in session.records]

    def session_ids(self, owner: str | None = None) -> list[str]:
        """The ids of ``owner``'s sessions, least recently written first."""
        with self._lock:
            return [sid for own, sid in self._sessions if own == owner]

    def total_bytes(self) -> int:
        """The estimated bytes of every record held."""
        with self._lock:
            return self._total_bytes


@dataclass
class _Session:
    records: deque = field(default_factory=deque)  # (Record, estimated bytes)
    bytes: int = 0
    live: dict = field(default_factory=dict)  # request id -> records of it still held
    evicted: int = 0
    evicted_requests: int = 0


def record_bytes(record: Record) -> int:
    """About what a record costs held and served: 8 bytes a token id or log-prob, its text's UTF-8, and 200
    for the rest (its JSON form in ``GET /rltk/sessions`` is of the same order)."""
    tokens = len(record.prompt_ids) + len(record.completion_ids) + len(record.logprobs)
    return 8 * tokens + len(record.text.encode("utf-8", "surrogatepass")) + 200


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
