"""Logger ``swanlab``: a SwanLab run, in the cloud, or offline in the run folder with no account.

``mode``: ``cloud`` (SwanLab's ``online``), ``offline`` (no network, no
account: written under ``<run_dir>/swanlog``, uploaded later with ``swanlab
sync``), ``local`` or ``disabled``; default ``$SWANLAB_MODE``, else
``offline`` when no API key is configured (``$SWANLAB_API_KEY``), else
``cloud``. An explicit cloud mode without a key fails at once, before SwanLab
could wait on a login prompt.

The project is ``project`` (verl's ``project_name``), the experiment name
``name`` (default: the config's ``name``). The config SwanLab stores is the
resolved run config with values read from the environment kept as their
``${oc.env:...}`` interpolation (:mod:`rltk.config.saved`). At ``close``,
``curves.png`` is logged as an image and the run folder's ``config.yaml`` is
saved with the run (as ``<run folder name>/config.yaml``: SwanLab's own
``config.yaml`` holds the params). The run id is kept in ``<run_dir>/swanlab_run_id`` so a
resumed run continues the same SwanLab run.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from rltk.loggers.base import Logger, as_path, scalar_metrics

RUN_ID_FILE = "swanlab_run_id"
MODES = {"cloud": "online", "online": "online", "offline": "offline", "local": "local", "disabled": "disabled"}


class SwanLabLogger(Logger):
    """Logs scalars to a SwanLab run (see the module docstring).

    Args:
        run_dir: the run folder; SwanLab files go to ``run_dir/swanlog``.
        config: the resolved run config, stored as the run's config.
        total_steps: stored in the run config as ``total_steps``.
        project, workspace, name, group, tags, description: as in ``swanlab.init``.
        mode: ``cloud``, ``offline``, ``local`` or ``disabled`` (see the module docstring).
        resume_step: set when resuming; the stored run id is reused.
    """

    def __init__(self, *, run_dir: str | Path, config: dict | None = None, total_steps: int | None = None,
                 project: str = "rltk", workspace: str | None = None, name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, description: str | None = None,
                 mode: str | None = None, resume_step: int | None = None):
        try:
            import swanlab
        except ImportError as exc:
            raise ImportError(
                f"the 'swanlab' logger needs the swanlab package ({exc}): `pip install swanlab` (or rltk[swanlab]), "
                "or remove 'swanlab' from logging.logger."
            ) from exc
        has_key = bool(os.environ.get("SWANLAB_API_KEY"))
        chosen = (mode or os.environ.get("SWANLAB_MODE") or ("cloud" if has_key else "offline")).lower()
        if chosen not in MODES:
            raise ValueError(f"swanlab logger: mode={chosen!r} (from the 'mode' argument or $SWANLAB_MODE) is not "
                             f"valid; use one of {', '.join(sorted(set(MODES) - {'online'}))}")
        if MODES[chosen] == "online" and not has_key:
            raise RuntimeError(
                "swanlab logger: mode=cloud needs an API key and none is set (SWANLAB_API_KEY). Set it, or use "
                "mode=offline (logging.logger_args.swanlab.mode=offline or SWANLAB_MODE=offline) to log into the "
                "run folder and `swanlab sync` later, or remove 'swanlab' from logging.logger."
            )
        self.swanlab = swanlab
        self.run_dir = as_path(run_dir, "swanlab")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        id_file = self.run_dir / RUN_ID_FILE
        resuming = id_file.exists()
        run_id = id_file.read_text().strip() if resuming else secrets.token_hex(8)[:21]
        if not resuming:
            id_file.write_text(run_id + "\n")
        run_config = dict(config or {})
        if total_steps is not None:
            run_config.setdefault("total_steps", total_steps)
        self.log_dir = self.run_dir / "swanlog"
        self.run = swanlab.init(
            project=project, workspace=workspace, name=name or run_config.get("name") or self.run_dir.name,
            group=group, tags=tags, description=description, config=run_config, mode=MODES[chosen],
            log_dir=str(self.log_dir), id=run_id, resume="allow" if resuming else None, reinit=True,
        )
        self.run_id = run_id
        self.mode = MODES[chosen]
        self._closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(scalar_metrics(metrics), step=int(step))

    def close(self) -> None:
        """Log curves.png as an image and save config.yaml with the run (those present), then finish it."""
        if self._closed:
            return
        self._closed = True
        curves = self.run_dir / "curves.png"
        if curves.is_file():
            self.run.log({"curves": self.swanlab.Image(str(curves))})
        config = self.run_dir / "config.yaml"
        if config.is_file() and self.mode != "disabled":
            # Saved as <run folder name>/config.yaml: SwanLab's own files/config.yaml holds the params. SwanLab
            # links the file rather than copying it, so it is named where it stays (an absolute glob: a relative
            # one is read against the working directory, not base_path).
            run_dir = self.run_dir.resolve()
            self.run.save(str(run_dir / "config.yaml"), base_path=str(run_dir.parent), policy="now")
        self.run.finish()
