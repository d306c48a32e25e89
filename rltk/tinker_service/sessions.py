"""Who holds what: sessions, their training clients (adapters) and samplers, per API key.

Everything is filed under its owner, a digest of the API key that created it. A request naming a
model, sampler, future or checkpoint of another key gets the same 404 as one naming nothing, so
keys cannot even learn each other's ids. Checkpoints live on disk under
``<state_dir>/<owner>/<model_id>/{weights,sampler_weights}/<name>``: a path is resolved inside the
caller's own folder only.

A session ends when its client calls ``/sessions/{id}/finish`` (``ServiceClient.close()``) or sends
no heartbeat (the SDK sends one every 10 s) for ``session_timeout_s``; then its adapters, optimizer
states, samplers and queued work are released. Saved checkpoints stay on disk: they are what the
client asked to keep.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

TINKER_SCHEME = "tinker://"
CHECKPOINT_KINDS = {"weights": "training state", "sampler_weights": "sampler weights"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
#: The SDK derives a training client's id itself, as ``{session_id}:train:{model_seq_id}``.
_MODEL_ID = re.compile(r"^[0-9a-f]{32}:train:[0-9]{1,9}$")


class NotFound(LookupError):
    """An id or path the caller does not own (or that does not exist): answered 404."""


def owner_of(api_key: str | None) -> str:
    """The namespace of an API key: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()[:16]


@dataclass
class Session:
    id: str
    owner: str
    last_seen: float
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)


@dataclass
class Model:
    id: str
    owner: str
    session: str
    rank: int
    base_model: str


@dataclass
class Sampler:
    id: str
    owner: str
    session: str
    model_path: str | None
    base_model: str


class Registry:
    """Sessions, models and samplers by id, each with its owner; see the module docstring."""

    def __init__(self, state_dir: Path, *, session_timeout_s: float = 120.0, max_models_per_owner: int = 4,
                 max_samplers_per_session: int = 8):
        self.state_dir = Path(state_dir)
        self.session_timeout_s = session_timeout_s
        self.max_models_per_owner = max_models_per_owner
        self.max_samplers_per_session = max_samplers_per_session
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}

    # ------------------------------------------------------------------ lookups (404 for others' ids)

    def session(self, session_id: str, owner: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFound(f"session_id: no live session {session_id!r} for this API key (finished, timed out "
                           "without heartbeats, or never created)")
        session.last_seen = time.monotonic()
        return session

    def model(self, model_id: str, owner: str) -> Model:
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise NotFound(f"model_id: no training client {model_id!r} for this API key")
        self.sessions[model.session].last_seen = time.monotonic()
        return model

    def sampler(self, sampler_id: str, owner: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.owner != owner:
            raise NotFound(f"sampling_session_id: no sampler {sampler_id!r} for this API key (samplers are "
                           f"released when their session ends; a session keeps its newest "
                           f"{self.max_samplers_per_session})")
        return sampler

    # ------------------------------------------------------------------ creation

    def new_session(self, owner: str) -> Session:
        session = Session(id=uuid.uuid4().hex, owner=owner, last_seen=time.monotonic())
        self.sessions[session.id] = session
        return session

    def new_model(self, session: Session, model_seq_id: int, rank: int, base_model: str) -> Model:
        model_id = f"{session.id}:train:{model_seq_id}"
        if model_id in self.models:
            raise ValueError(f"model_seq_id: {model_seq_id} is already a training client of this session")
        held = sum(1 for m in self.models.values() if m.owner == session.owner)
        if held >= self.max_models_per_owner:
            raise PermissionError(f"this API key already holds {held} training clients, this service's limit "
                                  f"(--max-models-per-key {self.max_models_per_owner}); close a ServiceClient "
                                  "(its session's clients are released) and retry")
        model = Model(id=model_id, owner=session.owner, session=session.id, rank=rank,
                      base_model=base_model)
        self.models[model.id] = model
        session.models.append(model.id)
        return model

    def new_sampler(self, session: Session, model_path: str | None, base_model: str) -> tuple[Sampler, list[str]]:
        """A sampler record, and the ids of the session's oldest samplers it pushed out (to release)."""
        sampler = Sampler(id=uuid.uuid4().hex, owner=session.owner, session=session.id, model_path=model_path,
                          base_model=base_model)
        self.samplers[sampler.id] = sampler
        session.samplers.append(sampler.id)
        evicted = []
        while len(session.samplers) > self.max_samplers_per_session:
            evicted.append(session.samplers.pop(0))
            self.samplers.pop(evicted[-1], None)
        return sampler, evicted

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_path(self, model: Model, kind: str, name: str) -> tuple[str, Path]:
        """``(tinker path, folder)`` for saving ``name``; raises ValueError naming ``path`` for a bad name."""
        if not _NAME.match(name or ""):
            raise ValueError(f"path: {name!r} is not a checkpoint name (letters, digits, '_', '.', '-'; at most "
                             "128 characters; not starting with '.')")
        return f"{TINKER_SCHEME}{model.id}/{kind}/{name}", self.state_dir / model.owner / model.id / kind / name

    def resolve_checkpoint(self, path: str, owner: str, kinds: tuple[str, ...] = ("weights",)) -> tuple[str, Path]:
        """``(model id, folder)`` of a saved ``tinker://MODEL/KIND/NAME`` of the caller's own."""
        parts = path[len(TINKER_SCHEME):].split("/") if path.startswith(TINKER_SCHEME) else []
        if len(parts) != 3 or parts[1] not in kinds or not _NAME.match(parts[2]) or not _MODEL_ID.match(parts[0]):
            wanted = " or ".join(f"tinker://MODEL_ID/{k}/NAME" for k in kinds)
            raise ValueError(f"path: {path!r} is not a checkpoint path of this service ({wanted})")
        folder = self.state_dir / owner / parts[0] / parts[1] / parts[2]
        if not folder.is_dir():
            raise NotFound(f"path: no checkpoint {path!r} saved by this API key")
        return parts[0], folder

    # ------------------------------------------------------------------ ending

    def end_session(self, session_id: str) -> tuple[list[str], list[str]] | None:
        """Forget a session; returns ``(model ids, sampler ids)`` whose weights to release, or None if unknown."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return None
        for model_id in session.models:
            self.models.pop(model_id, None)
        for sampler_id in session.samplers:
            self.samplers.pop(sampler_id, None)
        return list(session.models), list(session.samplers)

    def expired(self) -> list[str]:
        """Sessions whose last request or heartbeat is older than ``session_timeout_s``."""
        now = time.monotonic()
        return [s.id for s in self.sessions.values() if now - s.last_seen > self.session_timeout_s]
