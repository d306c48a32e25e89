"""save_weights_atomically: every rank of a run may write the same stage-weights file at once."""

import threading

import torch
from safetensors.torch import load_file

from rltk.training.scaffold.resume import save_weights_atomically


def test_concurrent_writers_of_one_file_do_not_take_it_from_each_other(tmp_path):
    target = tmp_path / "stage_weights" / "stage_1_reference.safetensors"
    state = {"a": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(3)}
    errors = []

    def write():
        try:
            for _ in range(20):
                save_weights_atomically(state, target)
        except Exception as exc:  # reported below: a rename that lost its file raises here
            errors.append(exc)

    writers = [threading.Thread(target=write) for _ in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    assert not errors, errors
    loaded = load_file(str(target))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary file left behind
