"""Private torch generators (e.g. GRPO's mini-batch shuffling) in a checkpoint: restored, not seeded again."""

from __future__ import annotations

import pytest
import torch

from rltk.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state


def used_generator(seed: int, draws: int) -> torch.Generator:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        torch.randperm(16, generator=generator)
    return generator


def test_a_loaded_generator_continues_the_saved_one_not_its_seed(tmp_path):
    manager = CheckpointManager(tmp_path)
    order, other = used_generator(0, draws=3), used_generator(7, draws=1)
    manager.save(3, None, {}, generators={"order": order, "other": other})
    expected = [torch.randperm(16, generator=order) for _ in range(3)]
    expected_other = torch.rand(4, generator=other)

    restored, restored_other = torch.Generator().manual_seed(0), torch.Generator()  # as a resumed recipe builds them
    # seeding again would replay the first draw instead of continuing
    assert not torch.equal(torch.randperm(16, generator=torch.Generator().manual_seed(0)), expected[0])
    manager.load(manager.latest(), None, generators={"order": restored, "other": restored_other})
    assert all(torch.equal(torch.randperm(16, generator=restored), e) for e in expected)
    assert torch.equal(torch.rand(4, generator=restored_other), expected_other)


def test_generators_do_not_disturb_the_global_rng_round_trip(tmp_path):
    torch.manual_seed(11)
    manager = CheckpointManager(tmp_path)
    manager.save(1, None, {}, generators={"order": used_generator(0, 2)})
    after_save = torch.rand(3)
    manager.load(manager.latest(), None)  # no generators asked for: the global state alone
    assert torch.equal(torch.rand(3), after_save)


def test_a_checkpoint_without_the_generator_warns_and_leaves_it_alone(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, None, {})  # written by an rltk that did not hand the generator over
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    with pytest.warns(UserWarning, match=r"no state for the generator\(s\) \['order'\] of rank 0.*not bitwise"):
        manager.load(manager.latest(), None, generators={"order": generator})
    assert torch.equal(generator.get_state(), state)


def test_restore_names_a_generator_the_capture_lacks():
    state = capture_rng_state({"order": torch.Generator()})
    with pytest.raises(KeyError, match=r"no generator\(s\) \['minibatch'\] \(it holds \['order'\]\)"):
        restore_rng_state(state, {"minibatch": torch.Generator()})


def test_generator_states_are_weights_only_loadable(tmp_path):
    torch.save(capture_rng_state({"order": used_generator(3, 1)}), tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert torch.equal(loaded["generators"]["order"], used_generator(3, 1).get_state())
