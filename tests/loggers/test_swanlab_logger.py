"""SwanLab offline: the run is written into the run folder with no account; its records are read back with
SwanLab's own reader and protobuf messages; cloud without a key is a clear error, at once."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("swanlab", reason="the swanlab logger's tests need swanlab (rltk[swanlab]); "
                                      "requirements/dev.lock installs it in CI")

from rltk.loggers.swanlab_logger import RUN_ID_FILE, SwanLabLogger  # noqa: E402

from tests.waits import scaled



@pytest.fixture(autouse=True)
def offline_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "home" / ".swanlab"))
    for var in ("SWANLAB_API_KEY", "SWANLAB_MODE"):
        monkeypatch.delenv(var, raising=False)


def records(run_dir):
    """Every record of the run's .swanlab files, as dicts (SwanLab's reader and protobuf messages)."""
    from google.protobuf.json_format import MessageToDict
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    out = []
    for path in sorted(run_dir.glob("swanlog/run-*/*.swanlab")):
        reader = DataStoreReader()
        reader.open(path)
        out += [MessageToDict(Record.FromString(raw)) for raw in reader]
        reader.close()
    return out


def test_offline_without_a_key_writes_config_metrics_image_and_config_file(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: demo\nkey: ${oc.env:SWANLAB_API_KEY}\n")
    logger = SwanLabLogger(run_dir=run_dir, config={"name": "demo", "key": "${oc.env:SWANLAB_API_KEY}",
                                                    "trainer": {"lr": 1e-4}}, total_steps=2)
    assert logger.mode == "offline"  # no key: offline by default, never a login prompt
    logger.log({"reward": 0.25, "eval/accuracy": 0.5}, 1)
    logger.log({"reward": 0.75}, 2)
    import matplotlib.image
    import numpy as np

    matplotlib.image.imsave(run_dir / "curves.png", np.zeros((4, 4, 3)))
    logger.close()
    logger.close()

    found = records(run_dir)
    scalars = sorted((r["scalar"]["key"], int(r["scalar"]["step"]), r["scalar"]["value"]["number"])
                     for r in found if "scalar" in r)
    assert scalars == [("eval/accuracy", 1, 0.5), ("reward", 1, 0.25), ("reward", 2, 0.75)]
    saved = [r["save"] for r in found if "save" in r]
    assert any(s.get("name") == "run/config.yaml" for s in saved)
    assert any(r.get("column", {}).get("columnKey") == "curves" for r in found)  # the image column
    assert any(r.get("finish", {}).get("state") == "RUN_STATE_FINISHED" for r in found)
    run_folder = next(run_dir.glob("swanlog/run-*"))
    stored = (run_folder / "files" / "config.yaml").read_text()  # the run's config, secret as interpolation
    assert "${oc.env:SWANLAB_API_KEY}" in stored and "demo" in stored
    assert (run_folder / "files" / "run" / "config.yaml").read_text() == (run_dir / "config.yaml").read_text()
    assert logger.run_id == (run_dir / RUN_ID_FILE).read_text().strip()


def test_cloud_without_a_key_fails_at_once_with_what_to_do(tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        SwanLabLogger(run_dir=tmp_path / "run", mode="cloud")
    assert time.monotonic() - started < scaled(10)
    assert "SWANLAB_API_KEY" in str(info.value) and "mode=offline" in str(info.value)
    assert not (tmp_path / "run").exists()


def test_unknown_mode_is_named(tmp_path):
    with pytest.raises(ValueError, match="mode='clod'"):
        SwanLabLogger(run_dir=tmp_path / "run", mode="clod")
