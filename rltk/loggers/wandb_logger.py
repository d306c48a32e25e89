"""Logger ``wandb``: Weights & Biases, online or offline.

``WANDB_MODE=offline`` (or ``mode: offline``) needs no network and no account:
runs are written under ``<run_dir>/wandb`` and can be uploaded later with
``wandb sync``. Online without credentials fails at construction with a message
saying what to do, before ``wandb.init`` could wait on a login prompt.

The run id is kept in ``<run_dir>/wandb_run_id`` so a resumed run continues the
same W&B run. W&B drops points whose step is lower than one it already has;
steps the interrupted run logged after its checkpoint therefore keep their
first values (identical for a deterministic run).
"""

from __future__ import annotations

import inspect
import os
import secrets
from pathlib import Path

from rltk.loggers.base import Logger, as_path, scalar_metrics

RUN_ID_FILE = "wandb_run_id"
MODE_ALIASES = {"dryrun": "offline", "run": "online"}  # older spellings W&B still accepts
OFFLINE_MODES = ("offline", "disabled")
ONLINE_MODES = ("online", "shared")


def _has_credentials(wandb) -> bool:
    """True when W&B finds an API key (env, settings or .netrc) without any interactive prompt."""
    if "prompt" in inspect.signature(wandb.login).parameters:
        return bool(wandb.login(prompt=False, verify=False))
    # Older wandb without login(prompt=...): the key sources it would read.
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import netrc
    from urllib.parse import urlsplit

    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


class WandbLogger(Logger):
    """Logs scalars to a W&B run.

    Args:
        run_dir: the run folder; W&B files go to ``run_dir/wandb``.
        config: the resolved run config, stored as the W&B run config.
        total_steps: stored in the run config as ``total_steps``.
        project, entity, name, group, tags: as in ``wandb.init``.
        mode: ``online``, ``offline`` or ``disabled``; default ``$WANDB_MODE``, else ``online``.
        resume_step: set when resuming; the stored run id is reused.
    """

    def __init__(self, *, run_dir: str | Path, config: dict | None = None, total_steps: int | None = None,
                 project: str = "rltk", entity: str | None = None, name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, mode: str | None = None,
                 resume_step: int | None = None):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                f"the 'wandb' logger needs the wandb package ({exc}): `pip install wandb` (or rltk[wandb]), "
                "or remove 'wandb' from logging.logger."
            ) from exc
        mode = (mode or os.environ.get("WANDB_MODE") or "online").lower()
        mode = MODE_ALIASES.get(mode, mode)
        if mode not in OFFLINE_MODES + ONLINE_MODES:
            raise ValueError(
                f"wandb logger: mode={mode!r} (from the 'mode' argument or $WANDB_MODE) is not valid; use "
                "'online', 'offline' or 'disabled'."
            )
        if mode in ONLINE_MODES and not _has_credentials(wandb):
            raise RuntimeError(
                "wandb logger: no W&B API key is configured, so an online run cannot start. Either set "
                "WANDB_MODE=offline (or logging.logger_args.wandb.mode=offline) to log locally without an "
                "account, run `wandb login` (or set WANDB_API_KEY), or remove 'wandb' from logging.logger."
            )
        self.run_dir = as_path(run_dir, "wandb")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        id_file = self.run_dir / RUN_ID_FILE
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)  # W&B ids are [a-z0-9]
            id_file.write_text(run_id + "\n")
        run_config = dict(config or {})
        if total_steps is not None:
            run_config.setdefault("total_steps", total_steps)
        self.run = wandb.init(
            project=project, entity=entity, name=name, group=group, tags=tags, config=run_config,
            dir=str(self.run_dir), mode=mode, id=run_id, resume="allow" if mode in ONLINE_MODES else None,
        )
        self.run_id = run_id
        self._closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(scalar_metrics(metrics), step=step)

    def close(self) -> None:
        if not self._closed:
            self.run.finish()
            self._closed = True
