"""Logger ``mlflow``: an MLflow run with the run's config as params, every metric, and its files as artifacts.

Where it writes: ``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a
local file store in ``<run_dir>/mlruns`` (no server, no network; open it with
``mlflow ui --backend-store-uri <run_dir>/mlruns``). MLflow 3 refuses file
stores unless ``MLFLOW_ALLOW_FILE_STORE`` is set: for the store in the run
folder it is set for this process (a value the user set wins). A database
(``sqlite:///...``) or a server (``http://...``) is one argument away.

The experiment is ``experiment`` (verl's ``project_name``), the run name
``run_name`` (default: the config's ``name``). Params are the resolved config
flattened to dotted keys, with values read from the environment kept as their
``${oc.env:...}`` interpolation (:mod:`rltk.config.saved`), exactly as in
``config.yaml``. At ``close`` the run folder's ``config.yaml`` and
``curves.png`` become artifacts. In a file store a metric's ``/`` is
written ``.`` (``eval.accuracy``): the store keeps each metric in a file at
its name's path, where ``reward`` and ``reward/exact_match`` cannot both be. The run id is kept in ``<run_dir>/mlflow_run_id``
so a resumed run continues the same MLflow run; params are then not logged
again (MLflow params are write-once).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rltk.loggers.base import Logger, as_path, scalar_metrics

RUN_ID_FILE = "mlflow_run_id"
#: MLflow's limit on a param value's length (and on params per batch call).
MAX_PARAM_LENGTH = 6000
MAX_PARAMS_PER_BATCH = 100
#: Files of the run folder uploaded at close, if present.
ARTIFACTS = ("config.yaml", "curves.png", "summary.json")


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"a.b.0.c": "value"}``, every value as text (MLflow params are strings)."""
    out: dict[str, str] = {}
    if isinstance(config, dict):
        if not config and prefix:
            out[prefix] = "{}"
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(config, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in config):
        for i, value in enumerate(config):
            out.update(flatten(value, f"{prefix}.{i}"))  # MLflow names allow no brackets
    else:
        text = "null" if config is None else str(list(config) if isinstance(config, tuple) else config)
        out[prefix] = text if len(text) <= MAX_PARAM_LENGTH else text[: MAX_PARAM_LENGTH - 3] + "..."
    return out


class MlflowLogger(Logger):
    """Logs the run to MLflow (see the module docstring).

    Args:
        run_dir: the run folder; the default file store is ``run_dir/mlruns``.
        config: the resolved run config (secrets kept as their interpolation), logged as params.
        total_steps: logged as the param ``total_steps``.
        experiment: the MLflow experiment (created if missing).
        run_name: the run's name; default the config's ``name``.
        tracking_uri: where to log; default ``$MLFLOW_TRACKING_URI``, else ``run_dir/mlruns``.
        tags: extra run tags.
        resume_step: set when resuming; the stored run id is reused.
    """

    def __init__(self, *, run_dir: str | Path, config: dict | None = None, total_steps: int | None = None,
                 experiment: str = "rltk", run_name: str | None = None, tracking_uri: str | None = None,
                 tags: dict[str, str] | None = None, resume_step: int | None = None):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(
                f"the 'mlflow' logger needs the mlflow package ({exc}): `pip install mlflow-skinny` (or rltk[mlflow]), "
                "or remove 'mlflow' from logging.logger."
            ) from exc
        self.run_dir = as_path(run_dir, "mlflow")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (self.run_dir / "mlruns").resolve().as_uri()
        self.file_store = uri.startswith("file:") or "://" not in uri
        if self.file_store:
            # MLflow 3 keeps file stores behind this switch; a store in the run folder is rltk's default.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        id_file = self.run_dir / RUN_ID_FILE
        config = dict(config or {})
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = run_name or config.get("name") or self.run_dir.name
            run = self.client.create_run(experiment_id, run_name=str(name), tags={"rltk": "1", **(tags or {})})
            self.run_id = run.info.run_id
            id_file.write_text(self.run_id + "\n")
            params = flatten(config)
            if total_steps is not None:
                params.setdefault("total_steps", str(total_steps))
            self._log_params(params)
        self.experiment_id = experiment_id
        self._closed = False

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start:start + MAX_PARAMS_PER_BATCH])

    def metric_name(self, key: str) -> str:
        """``key`` as this store names it: a file store keeps each metric in a file at its name's path, so
        ``reward`` (a file) and ``reward/exact_match`` (a file in a folder ``reward``) cannot both exist
        there: ``/`` becomes ``.`` in file stores only (databases and servers keep the name as logged)."""
        return key.replace("/", ".") if self.file_store else key

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [Metric(self.metric_name(k), v, now, int(step)) for k, v in scalar_metrics(metrics).items()]
        for start in range(0, len(values), 1000):  # MLflow's limit of metrics per batch call
            self.client.log_batch(self.run_id, metrics=values[start:start + 1000])

    def close(self) -> None:
        """Upload the run folder's config.yaml, curves.png and summary.json (those present), end the run."""
        if self._closed:
            return
        self._closed = True
        for name in ARTIFACTS:
            path = self.run_dir / name
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id)
