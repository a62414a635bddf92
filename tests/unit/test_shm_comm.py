"""The shared-memory collectives of a tensor-parallel group (distributed/shm.py over
csrc/shm_comm.cpp), between two real processes: the all-reduce of random float32 tensors of
several sizes (odd ones, and ones past a slot, which go in chunks) equals the sum in rank order
to the bit on both ranks; the all-gather and the broadcast (past the broadcast area) deliver
every byte; a peer that dies or stops answering ends the wait with an error, not a hang."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.multiprocessing as mp

from llmserve.distributed import shm

pytestmark = pytest.mark.skipif(shm.transport() != "shm", reason="the C++ extension is not built")

SIZES = [1, 7, 64, 1001, shm.SLOT_BYTES // 4 + 3, 3 * shm.SLOT_BYTES // 4 - 5]


def _tensor(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g) * (10.0 ** (rank * 3 - 2))  # scales apart: order matters


def _peer(path: str, mode: str, out: mp.Queue) -> None:
    comm = shm.ShmComm(path, 1, 2, timeout_s=30.0)
    if mode == "die":
        os._exit(3)
    if mode == "idle":  # alive, never answers
        time.sleep(60)
        return
    sums = [comm.all_reduce(_tensor(1, n)) for n in SIZES]
    gathered = comm.all_gather(torch.arange(5, dtype=torch.int64) + 100)
    received = pickle.loads(comm.broadcast(None))
    out.put((pickle.dumps(sums), gathered.tolist(), received))


@pytest.fixture
def segment():
    path = shm.create_segment(2)
    yield path
    os.unlink(path)


def _start(path: str, mode: str) -> tuple[mp.Process, mp.Queue]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_peer, args=(path, mode, out), daemon=True)
    p.start()
    return p, out


def test_all_reduce_gather_broadcast_two_processes(segment):
    peer, out = _start(segment, "ok")
    comm = shm.ShmComm(segment, 0, 2, timeout_s=60.0)
    mine = [comm.all_reduce(_tensor(0, n)) for n in SIZES]
    gathered = comm.all_gather(torch.arange(5, dtype=torch.int64))
    payload = {"tokens": list(range(400_000)), "tag": "big"}  # > the 1 MiB broadcast area pickled
    assert len(pickle.dumps(payload)) > shm.BROADCAST_BYTES
    comm.broadcast(pickle.dumps(payload))
    theirs_raw, their_gather, received = out.get(timeout=60)
    peer.join(timeout=30)
    theirs = pickle.loads(theirs_raw)
    for n, a, b in zip(SIZES, mine, theirs, strict=True):
        expected = _tensor(0, n) + _tensor(1, n)  # rank 0's plus rank 1's, one rounding per element
        assert torch.equal(a, expected), n
        assert torch.equal(b, expected), n
    assert gathered.tolist() == their_gather == [[0, 1, 2, 3, 4], [100, 101, 102, 103, 104]]
    assert received == payload


def test_dead_peer_fails_the_wait(segment):
    peer, _ = _start(segment, "die")
    comm = shm.ShmComm(segment, 0, 2, timeout_s=120.0)
    peer.join(timeout=30)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"tensor-parallel rank 1 \(pid {peer.pid}\) exited"):
        comm.all_reduce(torch.ones(10))
    assert time.monotonic() - started < 5


def test_zombie_peer_fails_the_wait(segment):
    """A worker that died but is not yet reaped (its parent, the driver, joins it later)."""
    peer, _ = _start(segment, "die")
    comm = shm.ShmComm(segment, 0, 2, timeout_s=120.0)
    # no join, no is_alive (either would reap it): the wait sees the peer start, then exit
    with pytest.raises(RuntimeError, match=rf"tensor-parallel rank 1 \(pid {peer.pid}\) exited"):
        comm.all_reduce(torch.ones(10))
    peer.join(timeout=10)  # (a dying process shows as a zombie a moment before it can be reaped)
    assert peer.exitcode == 3


def test_silent_peer_times_out(segment):
    peer, _ = _start(segment, "idle")
    comm = shm.ShmComm(segment, 0, 2, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no answer from the other ranks within 1 s"):
        comm.all_reduce(torch.ones(10))
    assert time.monotonic() - started < 5
    peer.kill()
    peer.join()


def test_abort_ends_the_peers_wait(segment):
    peer, _ = _start(segment, "idle")
    comm = shm.ShmComm(segment, 0, 2, timeout_s=120.0)
    comm.abort()
    with pytest.raises(RuntimeError, match="aborted"):
        comm.all_reduce(torch.ones(10))
    peer.kill()
    peer.join()


def test_transport_env(monkeypatch):
    monkeypatch.setenv(shm.ENV, "gloo")
    assert shm.transport() == "gloo"
    monkeypatch.setenv(shm.ENV, "tcp")
    with pytest.raises(ValueError, match="LLMSERVE_TP_TRANSPORT must be 'auto', 'shm' or 'gloo'; got 'tcp'"):
        shm.transport()


def test_segment_removed_when_the_workers_never_start():
    """A failed worker start (here: an error raised inside the block) leaves nothing in /dev/shm;
    a start that succeeds keeps the segment for the ranks to map."""
    path = shm.create_segment(2)
    with shm.unlinked_on_error(path):
        pass
    assert os.path.exists(path)
    with pytest.raises(OSError, match="no workers"), shm.unlinked_on_error(path):
        raise OSError("no workers")
    assert not os.path.exists(path)
    with shm.unlinked_on_error(None):  # gloo groups have no segment
        pass
