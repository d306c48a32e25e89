"""The broadcast wire (:mod:`rltk.rollout.weight_broadcast`) between real processes over gloo: buckets, exact
deltas, a group that cannot form, a receiver killed mid-transfer, a trainer killed mid-broadcast. No vLLM: the receivers are plain processes
that do what rltk's vLLM backend does with each bucket (the layout travels through the group's store here)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from rltk.rollout import weight_broadcast as wire

from tests.waits import scaled, wait_until

# A receiver: joins as `rank`, then for each update reads its layout from the store, receives the buckets into
# its copy and publishes the copy's digests; `die` SIGKILLs itself after the first bucket of the first update.
RECEIVER = """
import json, os, signal, sys
import torch
from rltk.rollout import weight_broadcast as wire

port, rank, world, updates, bucket, timeout, die = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                                    int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]),
                                                    sys.argv[7] == "die")
rendezvous = wire.store("127.0.0.1", port, world, is_master=False, timeout_s=timeout)
group = wire.join(rendezvous, "gloo", rank, world, timeout, address="127.0.0.1")
held = {}
for k in range(updates):
    pieces = json.loads(rendezvous.get(f"update/{k}"))
    for bucket_pieces in wire.receive(group, pieces, bucket, torch.device("cpu"), timeout):
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
        for entry, parts in bucket_pieces:
            wire.apply_piece(entry, parts, held)
    rendezvous.set(f"digest/{rank}/{k}", json.dumps({n: wire.digest(t) for n, t in held.items()}))
"""


def receivers(port, world, updates, bucket, timeout, *, ranks=None, die=()):
    return [subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(rank), str(world), str(updates),
                              str(bucket), str(timeout), "die" if rank in die else "live"])
            for rank in (ranks or range(1, world))]


def reap(processes):
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_buckets_are_bounded_aligned_and_a_large_tensor_goes_alone():
    pieces = [wire.piece(f"t{i}", torch.zeros(shape)) for i, shape in enumerate([(3,), (100,), (10, 10), (7,)])]
    pieces.append(wire.piece("sparse", torch.zeros(1000), nnz=5))  # 5 int32 indices + 5 fp32 values: 40 bytes
    layout = wire.bucket_layout(pieces, 410)
    # 12 -> 16 aligned, and 16 + 400 > 410: t1 starts the next; 28 -> 32, then 40 at 32 share the last
    assert [[(e["name"], off) for e, off in bucket] for bucket in layout] == [
        [("t0", 0)], [("t1", 0)], [("t2", 0)], [("t3", 0), ("sparse", 32)]]
    assert [wire.bucket_size(b) for b in layout] == [12, 400, 400, 72]
    [[(big, _)], *_] = wire.bucket_layout([wire.piece("big", torch.zeros(1000))], 1024)
    assert big["name"] == "big"  # 4000 bytes > the bucket: alone


def test_a_delta_is_exact_to_the_bit_nans_and_signed_zeros_included():
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0, -3.0])
    new = base.clone()
    new[0] = -0.0  # equal as floats, another bit pattern
    new[4] = 5.0
    entry, (indices, values) = wire.encode_delta("w", new, base, density_threshold=0.5)
    assert entry["nnz"] == 2 and indices.tolist() == [0, 4] and indices.dtype == torch.int32
    held = {"w": base.clone()}
    wire.apply_piece(entry, (indices, values), held)
    assert wire.digest(held["w"]) == wire.digest(new) != wire.digest(base)
    assert wire.encode_delta("w", new.clone(), new, 0.5) is None  # nothing changed: nothing sent
    dense, (tensor,) = wire.encode_delta("w", new * 2, new, 0.5)  # 3 of 5 changed: above the density, dense
    assert "nnz" not in dense and wire.digest(tensor) == wire.digest(new * 2)


def _updates():
    """Four versions of a small model: a start, a sparse step, one tensor mostly changed, bit-only changes."""
    torch.manual_seed(0)
    v0 = {"embed": torch.randn(50, 16), "layer.w": torch.randn(16, 16).to(torch.bfloat16), "norm": torch.ones(16)}
    v1 = {k: t.clone() for k, t in v0.items()}
    v1["embed"][3, :4] += 0.25
    v1["layer.w"][0, 0] = float("nan")
    v2 = {k: t.clone() for k, t in v1.items()}
    v2["norm"][:12] *= 1.5  # 75 % of one tensor: over the threshold, sent dense
    v3 = {k: t.clone() for k, t in v2.items()}
    v3["embed"][0, 0] = -v3["embed"][0, 0] if v3["embed"][0, 0] == 0 else v3["embed"][0, 0].neg()
    v3["layer.w"][1, 1] = torch.tensor(float("nan"), dtype=torch.bfloat16).view(torch.int16).add(1).view(torch.bfloat16)
    return [v0, v1, v2, v3]


def test_full_then_deltas_rebuild_the_senders_weights_bit_for_bit_on_every_receiver():
    timeout = scaled(120)
    versions = _updates()
    rendezvous = wire.store("127.0.0.1", 0, 3, is_master=True, timeout_s=timeout)
    processes = receivers(rendezvous.port, 3, len(versions), bucket=1024, timeout=timeout)
    try:
        group = wire.join(rendezvous, "gloo", 0, 3, timeout, address="127.0.0.1")
        sent, base = [], None
        for k, state in enumerate(versions):
            encoded = [wire.encode_delta(n, t, None if base is None else base[n], 0.5) for n, t in state.items()]
            encoded = [e for e in encoded if e is not None]
            pieces = [entry for entry, _ in encoded]
            rendezvous.set(f"update/{k}", json.dumps(pieces))
            sent.append(wire.send(group, pieces, {e["name"]: p for e, p in encoded}, 1024, torch.device("cpu"),
                                  timeout))
            want = {n: wire.digest(t) for n, t in state.items()}
            for rank in (1, 2):
                assert json.loads(rendezvous.get(f"digest/{rank}/{k}")) == want, (k, rank)
            base = state
        # bytes on the wire (the last piece of a bucket unpadded): the embedding alone, then 512 + 64 bytes
        assert sent[0] == 50 * 16 * 4 + (16 * 16 * 2 + 16 * 4)
        assert sent[1] == 4 * (4 + 4) + 1 * (4 + 2)  # 4 fp32 and 1 bf16 elements with their int32 indices
        assert sent[2] == 16 * 4  # the norm, 12 of 16 changed: dense
        assert sent[3] == 16 + 1 * (4 + 2)  # one element of each (the first padded to 16 bytes)
        for process in processes:
            assert process.wait(timeout=timeout) == 0
        # the store and gloo's pairs listen on the loopback only (torch's own store would take every interface)
        psutil = pytest.importorskip("psutil")
        listening = {c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN}
        assert listening and all(ip.startswith("127.") or ip.endswith("127.0.0.1") for ip in listening), listening
    finally:
        reap(processes)


def test_a_group_that_cannot_form_names_the_rank_that_never_joined_within_its_timeout():
    timeout = 3.0
    rendezvous = wire.store("127.0.0.1", 0, 3, is_master=True, timeout_s=scaled(60))
    processes = receivers(rendezvous.port, 3, 0, bucket=1024, timeout=scaled(60), ranks=[1])  # rank 2 never comes
    try:
        import torch.distributed as dist

        # rank 1 has announced itself (importing torch takes a while) before the group's own timeout starts
        announced = dist.PrefixStore(f"{wire.PREFIX}/0", rendezvous)
        wait_until(lambda: announced.check(["joined/1"]), "rank 1 to announce itself", 60,
                   alive=lambda: processes[0].poll() is None)
        start = time.monotonic()
        with pytest.raises(wire.GroupError, match=r"did not form within 3 s: ranks \[2\] never joined") as caught:
            wire.join(rendezvous, "gloo", 0, 3, timeout, address="127.0.0.1")
        assert caught.value.missing == [2]
        assert timeout <= time.monotonic() - start < scaled(60)  # its own timeout, not a hang
    finally:
        reap(processes)


def test_a_receiver_killed_mid_transfer_fails_the_senders_broadcast_instead_of_hanging():
    timeout = scaled(60)
    state = {f"t{i}": torch.randn(4096) for i in range(64)}  # 64 buckets of 16 KiB
    rendezvous = wire.store("127.0.0.1", 0, 2, is_master=True, timeout_s=timeout)
    [victim] = processes = receivers(rendezvous.port, 2, 1, bucket=16384, timeout=timeout, die=(1,))
    try:
        group = wire.join(rendezvous, "gloo", 0, 2, timeout, address="127.0.0.1")
        pieces = [wire.piece(n, t) for n, t in state.items()]
        rendezvous.set("update/0", json.dumps(pieces))
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            wire.send(group, pieces, {n: (t,) for n, t in state.items()}, 16384, torch.device("cpu"), timeout)
        assert time.monotonic() - start < timeout
        assert victim.wait(timeout=timeout) == -9
    finally:
        reap(processes)


# A trainer: hosts the store, prints its port, joins as rank 0, publishes the update's layout, sends its first
# bucket and SIGKILLs itself (store and all) before the second.
DYING_SENDER = """
import json, os, signal, sys
import torch
from rltk.rollout import weight_broadcast as wire

timeout = float(sys.argv[1])
rendezvous = wire.store("127.0.0.1", 0, 2, is_master=True, timeout_s=timeout)
print(rendezvous.port, flush=True)
group = wire.join(rendezvous, "gloo", 0, 2, timeout, address="127.0.0.1")
state = {f"t{i}": torch.full((4096,), float(i)) for i in range(8)}  # 8 buckets of 16 KiB
pieces = [wire.piece(n, t) for n, t in state.items()]
rendezvous.set("update/0", json.dumps(pieces))
[first, *_] = wire.bucket_layout(pieces, 16384)
wire.broadcast(group, wire.pack(first, {n: (t,) for n, t in state.items()}, torch.device("cpu")), timeout)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_trainer_killed_mid_broadcast_fails_the_receivers_update_within_its_timeout_and_nothing_is_applied():
    timeout = scaled(60)
    sender = subprocess.Popen([sys.executable, "-c", DYING_SENDER, str(timeout)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(sender.stdout.readline())
        rendezvous = wire.store("127.0.0.1", port, 2, is_master=False, timeout_s=timeout)
        group = wire.join(rendezvous, "gloo", 1, 2, timeout, address="127.0.0.1")
        pieces = json.loads(rendezvous.get("update/0"))
        received, staged = 0, {}
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            for bucket_pieces in wire.receive(group, pieces, 16384, torch.device("cpu"), timeout):
                received += 1
                for entry, parts in bucket_pieces:
                    wire.apply_piece(entry, parts, staged)
        assert time.monotonic() - start < timeout  # the dead peer is noticed, not waited on for ever
        # what came before the death, and nothing more: the rltk_broadcast worker stages a delta run's buckets
        # like this and loads them only once every bucket is in; a full-weights run's server stays paused by
        # the trainer, which paused it before the first bucket and died before resuming it
        assert received == 1 and sorted(staged) == ["t0"]
        assert sender.wait(timeout=timeout) == -9
    finally:
        reap([sender])
