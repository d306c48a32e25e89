"""Weight publish-to-loaded seconds: through Ray's object store (``launcher=ray``) against the weights file
(``launcher=local``), at the 20M and 100M models of benchmarks/vllm_rollout.py, into a producer's module.

A Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``): the head holds the trainer (this
process) and the queue front actor, the other node a producer-like actor with the model. Two nodes, two object
stores: the object travels between them as between machines, here over loopback. Each round publishes a new
version both ways, the order alternating from round to round:

* ``file``: the trainer writes the safetensors file (``write_weights_file``: written aside, renamed into place)
  and the actor reads it into its module (``read_weights_file``), as a local producer does. The file is on this
  machine's disk; across machines it would be on a network file system, slower.
* ``ray``: the trainer puts a CPU copy of the weights into the object store and announces the version on a
  :class:`~rltk.training.rollouts.asynchronous.ray_source.QueueFront` (``publish_weights``), and the actor's
  :class:`~rltk.training.rollouts.asynchronous.ray_source.RayWeightsFollower` asks the version, fetches the object and
  loads it, as a Ray producer does.

Timed from the start of the publish to the actor's return (one actor call in both). Medians over ``--rounds``,
and ray/file pair by pair. A vLLM server's own load (``vllm_server``) is the same in both ways once its file is
on its node, and is left out.

    python benchmarks/ray_weights.py                       # 20M and 100M, 7 rounds
    python benchmarks/ray_weights.py --models 20M --rounds 3

Times depend on what else the machine runs: quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_rollout import MODELS  # noqa: E402  the same model shapes

RESULTS = Path(__file__).resolve().parent / "results"


class Loader:
    """The producer's side: one model, loaded from the file or through the follower."""

    def __init__(self, name: str, front, folder: str):
        import torch

        from rltk.models.tiny import build_char_tokenizer, build_tiny_model
        from rltk.training.rollouts.asynchronous.ray_source import RayWeightsFollower

        torch.set_num_threads(1)
        self.model = build_tiny_model(build_char_tokenizer(), **MODELS[name], max_position_embeddings=256, seed=1)
        engine = types.SimpleNamespace(loads_weight_files=False, continued=0)  # the hf engine's: loads the module
        self.follower = RayWeightsFollower(engine, self.model, f"{folder}/own.safetensors", front=front,
                                           timeout_s=600)

    def load_file(self, path: str) -> int:
        from rltk.training.rollouts.engine_weights import read_weights_file

        return read_weights_file(self.model, path)

    def load_ray(self) -> int:
        assert self.follower.follow()
        return self.follower.version


def bench(name: str, rounds: int, folder: Path) -> dict:
    import ray

    from rltk.models.tiny import build_char_tokenizer, build_tiny_model
    from rltk.training.rollouts.engine_weights import write_weights_file
    from rltk.training.scaffold.ray_cluster import pinned_here
    from rltk.training.rollouts.asynchronous.ray_source import QueueFront, publish_weights

    model = build_tiny_model(build_char_tokenizer(), **MODELS[name], max_position_embeddings=256, seed=0)
    params = sum(p.numel() for p in model.parameters())
    front = ray.remote(QueueFront).options(**pinned_here()).remote(str(folder / "queue.sqlite"), "wal", 600.0)
    loader = ray.remote(Loader).options(num_cpus=1, resources={"producer": 1}).remote(name, front, str(folder))
    path = folder / "policy.safetensors"
    times: dict[str, list[float]] = {"file": [], "ray": []}
    held = None
    version = 0
    for r in range(rounds + 1):  # round 0 warms both ways up, not counted
        for way in (("file", "ray") if r % 2 else ("ray", "file")):
            version += 1
            start = time.perf_counter()
            if way == "file":
                write_weights_file(model, path, version)
                loaded = ray.get(loader.load_file.remote(str(path)), timeout=600)
            else:
                held = publish_weights(front, model.state_dict(), version, 600)
                loaded = ray.get(loader.load_ray.remote(), timeout=600)
            assert loaded == version
            if r:
                times[way].append(time.perf_counter() - start)
    del held
    ray.kill(loader), ray.kill(front)
    ratios = [ray_s / file_s for ray_s, file_s in zip(times["ray"], times["file"])]
    return {"model": name, "params": params, "mb": params * 4 / 2**20, "file_s": times["file"],
            "ray_s": times["ray"], "file_median_s": statistics.median(times["file"]),
            "ray_median_s": statistics.median(times["ray"]), "ray_over_file_median": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["20M", "100M"], choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "ray_weights.json")
    args = parser.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False,
                                                                object_store_memory=1 << 30))
    cluster.add_node(num_cpus=1, resources={"producer": 1}, object_store_memory=1 << 30)
    ray.init(address=cluster.address)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="rltk_ray_weights_") as tmp:
            for name in args.models:
                folder = Path(tmp) / name
                folder.mkdir()
                results.append(r := bench(name, args.rounds, folder))
                print(f"{name:>5} ({r['mb']:.0f} MB fp32): file {r['file_median_s']:.3f} s, ray "
                      f"{r['ray_median_s']:.3f} s (median of {args.rounds}), ray/file {r['ray_over_file_median']:.2f}",
                      flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
