"""What the ranks of one server share for the in-host stage on the CPU (passing.torch.in_host): a
memory segment, a file with no name that local rank 0 makes in /dev/shm and hands to the others over
a Unix socket of the abstract namespace, and the barrier over those sockets (ServerBarrier). Nothing of
it is ever in a file system, so nothing outlives the processes however they end.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import struct
import tempfile
import time
import uuid

import torch.distributed as dist

from ..errors import PassingError

log = logging.getLogger("passing.torch")

SHM_DIR = "/dev/shm"


class ServerBarrier:
    """A barrier of the ranks of one server over Unix sockets: each rank tells local rank 0 it is
    there, and rank 0 answers all once everyone is. One wake-up each way, in the calling thread
    (a gloo barrier goes through gloo's threads and TCP: ten times the latency on a loaded
    machine), and a rank that exits shows at once as its socket's end.

    A rank whose collective fails (its network stage raised) poisons the barrier: it tells the others
    (rank 0 passes it on) and closes its sockets, so every rank's current call fails with an error
    that says so, and every later one too. Never a barrier out of phase, which would hand the others
    a sum of the wrong chunks."""

    def __init__(self, rank: int, peers: list[socket.socket]) -> None:
        self.rank, self.peers = rank, peers  # rank 0: one socket per other rank, in rank order; else: rank 0's
        self.strangers_dropped = 0  # rank 0: connections to the hand-over that were none of the ranks

    def wait(self) -> None:
        if not self.peers:
            raise PassingError("the in-host stage failed earlier (on this local rank or another): it is unusable")
        try:
            if self.rank == 0:
                for k, peer in enumerate(self.peers, 1):
                    _receive_mark(peer, f"local rank {k}")
                for k, peer in enumerate(self.peers, 1):
                    _send_mark(peer, f"local rank {k}")
            else:
                _send_mark(self.peers[0], "local rank 0")
                _receive_mark(self.peers[0], "local rank 0")
        except BaseException:
            self.poison()  # the others hear of it at their barrier at once, not at the timeout
            raise

    def poison(self) -> None:
        """Tell the other ranks this stage failed (as far as they can still hear it), and close it."""
        for peer in self.peers:
            try:
                peer.send(FAILED, socket.MSG_DONTWAIT)
            except OSError:
                pass  # gone already, or its buffer full: the close says it then
        self.close()

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.peers = []


STRANGERS = 16  # room in the listening queue beyond the ranks, for connections the hand-over drops
GO, FAILED = b".", b"x"  # a barrier's marks: here / this rank's collective failed


def _send_mark(peer: socket.socket, who: str) -> None:
    try:
        peer.sendall(GO)
    except OSError as e:  # its end closed: it exited, or failed and poisoned the barrier
        if _pending_mark(peer) == FAILED:  # it said so before it closed
            raise _failed_on(who) from None
        raise PassingError(f"the in-host stage: {who} is gone or failed ({e.strerror})") from None


def _pending_mark(peer: socket.socket) -> bytes:
    """A mark already received on ``peer`` (b"" when none)."""
    try:
        return peer.recv(1, socket.MSG_DONTWAIT)
    except OSError:
        return b""


def _failed_on(who: str) -> PassingError:
    return PassingError(f"the in-host stage: a collective failed on {who} (or a rank it heard from); it fails "
                        f"on every local rank, and so will every later one of this process group")


def _receive_mark(peer: socket.socket, who: str) -> None:
    try:
        mark = peer.recv(1)
    except TimeoutError:
        raise PassingError(f"the in-host stage: {who} did not reach the barrier within "
                           f"{peer.gettimeout():g} s") from None
    except OSError as e:
        raise PassingError(f"the in-host stage: {who} is gone or failed ({e.strerror})") from None
    if not mark:
        raise PassingError(f"the in-host stage: {who} left it (exited, or failed and gave up)")
    if mark == FAILED:
        raise _failed_on(who)


def _anonymous_segment(directory: str, nbytes: int) -> int:
    """A file of ``nbytes`` in ``directory`` that has no name (O_TMPFILE; where the file system has
    none, one unlinked at once): it goes when the last process that maps it or holds it does,
    whichever way they end, SIGKILL included. Its descriptor is handed to the other ranks."""
    try:
        fd = os.open(directory, os.O_RDWR | os.O_TMPFILE | os.O_EXCL, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        fd, path = tempfile.mkstemp(prefix="passing-", dir=directory)
        os.unlink(path)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # no space shows here, not as a SIGBUS on first touch
    except BaseException:
        os.close(fd)
        raise
    return fd


def shared_memory(store: dist.Store, prefix: str, rank: int, size: int, nbytes: int, timeout: float,
                  directory: str = SHM_DIR) -> tuple[mmap.mmap, ServerBarrier] | str:
    """A memory segment of ``nbytes`` and a barrier for the ``size`` ranks of a server, or why
    there are none (the same answer on every one of them). Nothing of it is ever in a file system:
    local rank 0 makes the segment as a file with no name in ``directory`` and listens on a Unix
    socket of the abstract namespace, whose random name it publishes in ``store``; every other rank
    connects and says its rank; once all could, rank 0 accepts them (only processes of its own user)
    and hands each the segment's descriptor over its socket, and each says whether it could map it.
    So nothing outlives the processes, however they end."""
    segment: mmap.mmap | None = None
    sockets: list[socket.socket] = []
    fd = -1
    dropped = 0
    error = ""
    try:  # 1. rank 0 makes the segment and the listening socket; the others connect
        if rank == 0:
            try:
                fd = _anonymous_segment(directory, nbytes)
                segment = mmap.mmap(fd, nbytes)
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sockets.append(listener)
                name = f"passing-{uuid.uuid4().hex}"
                listener.bind("\0" + name)
                listener.listen(size + STRANGERS)
            except OSError as e:
                store.set(prefix + "path", "")
                raise OSError(f"cannot set up {nbytes} bytes in {directory}: {e.strerror}") from e
            store.set(prefix + "path", name)
        else:
            name = store.get(prefix + "path").decode()
            if not name:
                raise OSError("local rank 0 could not make them")
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sockets.append(peer)
            peer.settimeout(timeout)
            peer.connect("\0" + name)
            peer.sendall(bytes([rank]))
    except (OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    failures = _agree(store, f"{prefix}connected/", rank, size, error)
    try:  # 2. rank 0 hands the segment over; the others map it
        error = ""
        if not failures:
            if rank == 0:
                sockets, dropped = _accept(sockets.pop(), size, timeout)
                for peer in sockets:
                    socket.send_fds(peer, [b"s"], [fd])
            else:
                _, fds, _, _ = socket.recv_fds(sockets[0], 1, 1)
                if len(fds) != 1:
                    raise OSError("local rank 0 sent no segment")
                try:
                    segment = mmap.mmap(fds[0], nbytes)
                finally:
                    os.close(fds[0])
    except (OSError, ValueError, PassingError) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        if fd >= 0:
            os.close(fd)  # the mapping keeps the segment
    if not failures:
        failures = _agree(store, f"{prefix}mapped/", rank, size, error)
    if failures:
        for s in sockets:
            s.close()
        if segment is not None:
            segment.close()
        return failures
    assert segment is not None
    barrier = ServerBarrier(rank, sockets)
    barrier.strangers_dropped = dropped
    return segment, barrier


def _agree(store: dist.Store, prefix: str, rank: int, size: int, error: str) -> str:
    """Every rank's outcome of a step, through the store: "" when all succeeded, else what failed where."""
    store.set(f"{prefix}{rank}", error or "ok")
    outcomes = [store.get(f"{prefix}{r}").decode() for r in range(size)]
    return "; ".join(f"local rank {r}: {o}" for r, o in enumerate(outcomes) if o != "ok")


def _accept(listener: socket.socket, size: int, timeout: float) -> tuple[list[socket.socket], int]:
    """Local rank 0's ends of the barrier: one connection from each other rank, which names itself, from a
    process of this user (the abstract namespace has no permissions of its own, and its names are in
    /proc/net/unix for anyone to see). Any other connection (another user's, or one that does not name a rank
    still missing) is dropped, logged and counted, and the hand-over goes on waiting for the ranks until
    ``timeout``. Returns the ranks' sockets in rank order and how many strangers were dropped."""
    by_rank: dict[int, socket.socket] = {}  # closed, all of them, if the barrier cannot be made
    dropped = 0
    deadline = time.monotonic() + timeout
    try:
        while len(by_rank) < size - 1:
            listener.settimeout(max(deadline - time.monotonic(), 1e-3))
            peer, _ = listener.accept()
            why = _stranger(peer, size, by_rank, deadline)
            if why:
                dropped += 1
                log.warning("passing: the in-host stage's hand-over dropped a connection (%d so far): %s", dropped,
                            why)
                peer.close()
                continue
            peer.settimeout(timeout)  # the barrier's waits
    except OSError as e:
        for peer in by_rank.values():
            peer.close()
        raise PassingError(f"the in-host stage: the other local ranks did not all connect to its barrier "
                           f"({type(e).__name__}: {e})") from None
    finally:
        listener.close()
    return [by_rank[k] for k in range(1, size)], dropped


def _stranger(peer: socket.socket, size: int, by_rank: dict[int, socket.socket], deadline: float) -> str:
    """Why ``peer`` is not one of the local ranks ("" when it is: it is then in ``by_rank``)."""
    _, uid, _ = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        return f"a process of user {uid}"
    peer.settimeout(max(deadline - time.monotonic(), 1e-3))
    try:
        said = peer.recv(1)
    except OSError as e:
        return f"it said nothing ({type(e).__name__})"
    if not said or not 1 <= said[0] < size or said[0] in by_rank:
        return f"it said {said!r}, not a rank of 1..{size - 1} not yet connected"
    by_rank[said[0]] = peer
    return ""
