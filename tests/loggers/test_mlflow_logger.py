"""MLflow: a local file store in the run folder, read back with MLflow's own client; resume keeps the run."""

from __future__ import annotations

import pytest

pytest.importorskip("mlflow", reason="the mlflow logger's tests need mlflow-skinny (rltk[mlflow]); "
                                     "requirements/dev.lock installs it in CI")

from mlflow.tracking import MlflowClient  # noqa: E402

from rltk.loggers.mlflow_logger import RUN_ID_FILE, MlflowLogger, flatten  # noqa: E402


@pytest.fixture(autouse=True)
def no_tracking_server(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_flatten_gives_dotted_keys_and_text_values():
    config = {"algorithm": {"name": "grpo", "kl_coef": 0.05, "advantage_fn_args": {}},
              "reward": {"reward_fn": ["exact_match", "format_tags"]}, "model": {"path": None},
              "stages": [{"name": "warmup", "type": "sft"}, {"name": "rl", "type": "rl"}]}
    assert flatten(config) == {
        "algorithm.name": "grpo", "algorithm.kl_coef": "0.05", "algorithm.advantage_fn_args": "{}",
        "reward.reward_fn": "['exact_match', 'format_tags']", "model.path": "null",
        "stages.0.name": "warmup", "stages.0.type": "sft", "stages.1.name": "rl", "stages.1.type": "rl",
    }
    assert len(flatten({"long": "x" * 7000})["long"]) == 6000


def test_a_run_in_a_local_file_store_holds_params_metrics_and_artifacts(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: demo\nwandb_key: ${oc.env:WANDB_API_KEY}\n")
    config = {"name": "demo", "trainer": {"lr": 1e-4}, "wandb_key": "${oc.env:WANDB_API_KEY}"}
    logger = MlflowLogger(run_dir=run_dir, config=config, total_steps=3, experiment="rltk-test")
    logger.log({"reward": 0.25, "eval/accuracy": 0.5}, 1)
    logger.log({"reward": 0.75}, 2)
    (run_dir / "curves.png").write_bytes(b"\x89PNG fake")
    logger.close()
    logger.close()  # safe twice

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run = client.get_run((run_dir / RUN_ID_FILE).read_text().strip())
    assert run.info.run_name == "demo" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "rltk-test"
    # the secret stays its interpolation, as in config.yaml
    assert run.data.params == {"name": "demo", "trainer.lr": "0.0001", "wandb_key": "${oc.env:WANDB_API_KEY}",
                               "total_steps": "3"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward")] == [(1, 0.25), (2, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval.accuracy")] == [(1, 0.5)]
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["config.yaml", "curves.png"]

    resumed = MlflowLogger(run_dir=run_dir, config={"name": "demo", "trainer": {"lr": 2e-4}}, resume_step=2,
                           experiment="rltk-test")
    assert resumed.run_id == run.info.run_id  # the same run continues; params are write-once, not re-logged
    resumed.log({"reward": 1.0}, 3)
    resumed.close()
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward")] == [1, 2, 3]
    assert client.get_run(run.info.run_id).data.params["trainer.lr"] == "0.0001"


@pytest.mark.slow
def test_rltk_run_with_the_mlflow_logger(tmp_path):
    from rltk.commands.cli import main

    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", "logging.logger=[jsonl,mlflow]",
                 "logging.logger_args.mlflow.experiment=rltk-e2e", "data.train_size=40", "data.eval_size=8",
                 "sft.steps=2", "sft.stop_at_accuracy=null", "sft.warmup_steps=0", "trainer.total_steps=2",
                 "trainer.warmup_steps=0", "trainer.prompts_per_step=4", "rollout.n=2", "checkpoint.every=0"]) == 0
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run = client.get_run((run_dir / RUN_ID_FILE).read_text().strip())
    assert run.info.run_name == "grpo-tiny" and run.data.params["algorithm.name"] == "grpo"
    assert run.data.params["trainer.total_steps"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward")] == [3, 4]  # after 2 warm-up steps
    # beside `reward`, each reward function's own (reward/exact_match, a folder in a file store: see metric_name)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward.exact_match")] == [3, 4]
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["config.yaml", "curves.png",
                                                                             "summary.json"]
