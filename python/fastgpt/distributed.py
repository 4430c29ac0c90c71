"""fastgpt.distributed: data-parallel training over processes, started by torchrun, Slurm's srun or mpiexec.

    rank, world_size, local_rank = fastgpt.distributed.init()   # reads the launcher's environment
    model = fastgpt.GPT(config, device="cuda")                   # cuda:LOCAL_RANK, a replica synced with rank 0
    opt = fastgpt.AdamW(model, zero_stage=1)                     # optional: moments sharded over ranks (ZeRO-1)

The engine reduces gradients with a communicator: NCCL for CUDA models, MPI (through mpi4py: `pip install
"fastgpt[mpi]"`) for CPU models, so the whole mechanism runs and is tested on CPUs. NCCL's unique id travels over
MPI when mpiexec started the job, otherwise over a small TCP rendezvous at MASTER_ADDR:MASTER_PORT (see
`_rendezvous`). A bad launch raises a clear error instead of hanging: every wait here has a deadline
(FASTGPT_DIST_TIMEOUT seconds, default 300), and under MPI an uncaught exception on one rank aborts the job.
"""
import atexit
import os
import pickle
import re
import socket
import struct
import sys
import time

import numpy as np

from . import _C

_group = None  # the process group of this job, set by init()


class _Group:
    def __init__(self, rank, world_size, local_rank, launcher, addr=None, port=None, mpi=None):
        self.rank, self.world_size, self.local_rank, self.launcher = rank, world_size, local_rank, launcher
        self.addr, self.port, self.mpi = addr, port, mpi
        self.comms = {}  # "cpu" / "cuda:N" -> _C.Comm


def _env_int(name, env):
    text = env.get(name)
    try:
        return int(text)
    except (TypeError, ValueError):
        raise RuntimeError(f"environment variable {name} must be an integer, got {text!r}") from None


def _timeout():
    text = os.environ.get("FASTGPT_DIST_TIMEOUT", "300")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise RuntimeError(f"FASTGPT_DIST_TIMEOUT must be a number of seconds > 0, got {text!r}")
    return value


def _first_slurm_host(nodelist):
    """First host of a Slurm node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    first = re.match(r"[^,\[]+(\[[^\]]*\])?", nodelist).group(0)
    if "[" not in first:
        return first
    prefix, ranges = first[:-1].split("[")
    return prefix + re.split("[,-]", ranges)[0]


def _mpi_launched(env):
    return any(k in env for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALRANKID"))


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError("this job was started by an MPI launcher but mpi4py is not installed: "
                           "pip install \"fastgpt[mpi]\" (mpi4py, with the mpich wheel if the system has no MPI)") from e
    return MPI


def _abort_job(comm):
    """MPI_Abort, once what this rank wrote has had a moment to travel: the launcher forwards each rank's output through
    a proxy and tears the proxies down at the abort, so a message written just before it can otherwise be lost."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.5)
    comm.Abort(1)


def _abort_on_uncaught(abort):
    """A rank that dies of an exception takes the job down instead of leaving the others blocked in a collective."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        abort()

    sys.excepthook = hook


def _exit_together(comm, rank):
    """A rank leaving early (sys.exit, a return) while the others wait in a collective would hang them: at exit
    every rank meets the others in a barrier, and one that waits longer than FASTGPT_DIST_TIMEOUT aborts the job."""
    timeout = _timeout()

    def at_exit():
        request, deadline = comm.Ibarrier(), time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                sys.stderr.write(f"fastgpt.distributed: rank {rank} is exiting, but not every rank reached the end "
                                 f"within {timeout:g} s (FASTGPT_DIST_TIMEOUT): aborting the job\n")
                _abort_job(comm)
            time.sleep(0.005)

    atexit.register(at_exit)  # after mpi4py's own handler was registered, so it runs before MPI is finalized


def init():
    """Joins the job the launcher started and returns (rank, world_size, local_rank); (0, 1, 0) without one.
    Idempotent. torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. mpiexec: MPI's own rank and size.
    srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the rendezvous at MASTER_ADDR (default: the first node of
    the job) and MASTER_PORT (default: 29500 + SLURM_JOB_ID % 1000)."""
    global _group
    if _group is not None:
        return _group.rank, _group.world_size, _group.local_rank
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and not _mpi_launched(env)):
        rank, world, local = _env_int("RANK", env), _env_int("WORLD_SIZE", env), _env_int("LOCAL_RANK", env) \
            if "LOCAL_RANK" in env else 0
        if world < 1 or not 0 <= rank < world:
            raise RuntimeError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
        group = _Group(rank, world, local, "torchrun")
        if world > 1:
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                if not env.get(name):
                    raise RuntimeError(f"{name} is not set: with WORLD_SIZE={world} the ranks meet at "
                                       "MASTER_ADDR:MASTER_PORT (torchrun sets both)")
            group.addr, group.port = env["MASTER_ADDR"], _env_int("MASTER_PORT", env)
            if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's own store already listens there
                group.port += 1
    elif _mpi_launched(env):
        MPI = _import_mpi()
        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        if "WORLD_SIZE" in env and env["WORLD_SIZE"] != str(world):
            raise RuntimeError(f"WORLD_SIZE={env['WORLD_SIZE']} disagrees with the MPI launcher, which started "
                               f"{world} processes: unset WORLD_SIZE or launch that many")
        for name in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
            if name in env:
                local = _env_int(name, env)
                break
        else:
            local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        group = _Group(rank, world, local, "mpi", mpi=comm)
        if world > 1:
            _abort_on_uncaught(lambda: _abort_job(comm))
            _exit_together(comm, rank)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _env_int("SLURM_PROCID", env), _env_int("SLURM_NTASKS", env)
        local = _env_int("SLURM_LOCALID", env) if "SLURM_LOCALID" in env else 0
        if "WORLD_SIZE" in env and env["WORLD_SIZE"] != str(world):
            raise RuntimeError(f"WORLD_SIZE={env['WORLD_SIZE']} disagrees with SLURM_NTASKS={world}")
        group = _Group(rank, world, local, "slurm")
        if world > 1:
            nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            addr = env.get("MASTER_ADDR") or (_first_slurm_host(nodes) if nodes else None)
            if not addr:
                raise RuntimeError("Slurm job without MASTER_ADDR or SLURM_JOB_NODELIST: cannot find rank 0's host")
            port = _env_int("MASTER_PORT", env) if env.get("MASTER_PORT") else \
                29500 + _env_int("SLURM_JOB_ID", env) % 1000 if env.get("SLURM_JOB_ID") else 29500
            group.addr, group.port = addr, port
    else:
        if env.get("WORLD_SIZE", "1") not in ("", "1"):  # a launcher's variable without the launcher
            raise RuntimeError(f"WORLD_SIZE={env['WORLD_SIZE']} but no launcher started this process (no RANK, MPI "
                               "or Slurm variables): start it with torchrun, mpiexec or srun")
        group = _Group(0, 1, 0, "none")
    if env.get("FASTGPT_RDZV_PORT"):
        group.port = _env_int("FASTGPT_RDZV_PORT", env)
    _group = group
    return group.rank, group.world_size, group.local_rank


def is_initialized():
    return _group is not None


def rank():
    return _group.rank if _group else 0


def world_size():
    return _group.world_size if _group else 1


def local_rank():
    return _group.local_rank if _group else 0


def launcher():
    """'torchrun', 'mpi', 'slurm', 'none' (a single process), or None before init()."""
    return _group.launcher if _group else None


# ---- the engine's communicators ----------------------------------------------------------------------------------

class _MpiComm:
    """What the engine's MPI communicator calls (csrc/binding.cpp, PyComm): mpi4py on zero-copy NumPy views.
    all_reduce is reduce-scatter + all-gather, so every element is summed on one rank only and every rank ends with
    the same bits (MPI's own all-reduce may round differently per rank)."""

    overlaps = False  # True: the engine hands over gradients layer by layer (the NCCL path's order; for tests)

    def __init__(self, comm):
        from mpi4py import MPI
        self.MPI, self.comm, self.rank, self.world = MPI, comm, comm.Get_rank(), comm.Get_size()

    def reduce_scatter(self, x, shard, average):
        out = np.empty(shard, dtype=np.float32)
        self.comm.Reduce_scatter_block(x, out, op=self.MPI.SUM)
        if average:
            out /= np.float32(self.world)
        x[self.rank * shard:(self.rank + 1) * shard] = out

    def all_gather(self, x):
        self.comm.Allgather(self.MPI.IN_PLACE, x)

    def all_reduce(self, x, average):
        n = x.size
        shard = -(-n // self.world)
        if shard * self.world != n:  # pad to equal shards
            padded = np.zeros(shard * self.world, dtype=np.float32)
            padded[:n] = x
            self.all_reduce(padded, average)
            x[...] = padded[:n]
            return
        self.reduce_scatter(x, shard, average)
        self.all_gather(x.view(np.uint8))

    def broadcast(self, x, root):
        self.comm.Bcast(x, root=root)

    def all_reduce_host(self, x):
        parts = np.empty((self.world, x.size), dtype=np.float64)
        self.comm.Allgather(np.ascontiguousarray(x, dtype=np.float64), parts)
        total = parts[0].copy()
        for p in parts[1:]:  # rank order, the same on every rank
            total += p
        x[...] = total

    def barrier(self):
        self.comm.Barrier()


class _SelfComm:
    """A world of one: the data-parallel code path without a launcher (tests, notebooks)."""

    rank, world = 0, 1

    def reduce_scatter(self, x, shard, average):
        pass

    def all_gather(self, x):
        pass

    def all_reduce(self, x, average):
        pass

    def broadcast(self, x, root):
        pass

    def all_reduce_host(self, x):
        pass

    def barrier(self):
        pass


def _exchange(payload, info):
    """Rank 0's payload to every rank, and every rank's info (bytes) to rank 0, which checks them: over MPI when
    MPI launched the job, else the TCP rendezvous. Returns the payload."""
    g = _group
    if g.mpi is not None:
        infos = g.mpi.gather(info, root=0)
        error = _check_infos(infos) if g.rank == 0 else None
        payload, error = g.mpi.bcast((payload, error) if g.rank == 0 else None, root=0)
        if error:
            raise RuntimeError(error)
        return payload
    return _rendezvous(g.addr, g.port, g.rank, g.world_size, payload, info, _timeout())


def _check_infos(infos):
    seen = {}
    for r, info in enumerate(infos):
        if info in seen:
            host, dev = pickle.loads(info)
            return (f"ranks {seen[info]} and {r} both use GPU {dev} on host {host}: one rank per GPU "
                    "(check LOCAL_RANK / CUDA_VISIBLE_DEVICES and --nproc_per_node)")
        seen[info] = r
    return None


def _comm_for(device):
    """The communicator of this job for models on `device` ('cpu' or 'cuda:N'), made once and shared."""
    init()
    g = _group
    if device in g.comms:
        return g.comms[device]
    if device == "cpu":
        if g.world_size == 1:
            comm = _C.Comm.mpi(_SelfComm(), 0, 1)
        elif g.mpi is None:
            raise RuntimeError(f"device='cpu' with {g.world_size} ranks reduces gradients over MPI: start the job "
                               f"with mpiexec -n {g.world_size} python ... ({g.launcher} started it)")
        else:
            comm = _C.Comm.mpi(_MpiComm(g.mpi.Dup()), g.rank, g.world_size)
    else:
        if not _C.built_with_nccl:
            raise RuntimeError("data parallel on CUDA needs NCCL, and this fastgpt was built without it: install "
                               "NCCL (pip install nvidia-nccl-cu13) and reinstall fastgpt")
        index = int(device.split(":")[1])
        # This rank's GPU becomes the process's current device, as torch.cuda.set_device(local_rank) in a DDP
        # script: otherwise each engine call's device guard would restore cudaGetDevice's default 0, making a CUDA
        # context on GPU 0 from every rank.
        _C.cuda_set_device(index)
        info = pickle.dumps((socket.gethostname(), index))
        uid = _C.nccl_unique_id() if g.rank == 0 else b""
        uid = _exchange(uid, info) if g.world_size > 1 else uid
        comm = _C.Comm.nccl(uid, g.rank, g.world_size, index)
        _abort_on_uncaught(comm.abort)
    g.comms[device] = comm
    return comm


def _host_comm():
    """The communicator host collectives use: MPI when launched by it, else this rank's GPU."""
    init()
    g = _group
    if g.world_size == 1 or g.mpi is not None:
        return _comm_for("cpu")
    if not (_C.built_with_cuda and _C.cuda_device_count() > 0):
        return _comm_for("cpu")  # raises: CPU processes need mpiexec
    return _comm_for(f"cuda:{g.local_rank}")


# ---- host collectives for the Python layer (train.py: losses, the run folder) -----------------------------------

def all_reduce(value, op="sum"):
    """Sum ('sum') or mean ('avg') over ranks of a number or a float array, in float64; the same on every rank."""
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    x = np.array(value, dtype=np.float64, copy=True).reshape(-1)
    if world_size() > 1:
        _host_comm().all_reduce_host(x)
    if op == "avg":
        x /= world_size()
    return float(x[0]) if np.ndim(value) == 0 else x.reshape(np.shape(value))


def broadcast_object(obj, root=0):
    """rank root's obj (anything pickle takes), returned on every rank."""
    if world_size() == 1:
        return obj
    g = _group
    if g.mpi is not None:
        return g.mpi.bcast(obj, root=root)
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if g.rank == root else np.zeros(0, np.uint8)
    size = all_reduce(float(data.size) if g.rank == root else 0.0)  # the others add zeros: exact
    buf = np.zeros(int(size), np.float64)
    if g.rank == root:
        buf[:] = data
    return pickle.loads(all_reduce(buf).astype(np.uint8).tobytes())


def barrier():
    if world_size() > 1:
        _host_comm().barrier()


# ---- the TCP rendezvous ------------------------------------------------------------------------------------------

_MAGIC = b"FGPT1"


def _recv_exact(sock, n):
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _send_msg(sock, data):
    sock.sendall(struct.pack("!Q", len(data)) + data)


_MAX_MSG = 1 << 20  # the rendezvous's messages are a few hundred bytes; a larger length is not one of ours


def _recv_msg(sock):
    size = struct.unpack("!Q", _recv_exact(sock, 8))[0]
    if size > _MAX_MSG:
        raise ConnectionError(f"message of {size} bytes announced: not a fastgpt rendezvous peer")
    return _recv_exact(sock, size)


def _rendezvous(addr, port, rank, world, payload, info, timeout):
    """Rank 0 listens on port, every other rank connects to addr:port (retrying while rank 0 is not up yet) and
    sends (rank, world, info); once all world-1 have arrived and agree, rank 0 answers each with its payload (NCCL's
    unique id, 128 bytes) or with the error. Everything shares one deadline: `timeout` seconds after the call, a rank
    still waiting raises a RuntimeError saying who is missing. The standard library suffices for so few bytes."""
    deadline = time.monotonic() + timeout
    where = f"{addr}:{port}"

    def left():
        return max(deadline - time.monotonic(), 0.001)

    if rank == 0:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(("", port))
        except OSError as e:
            server.close()
            raise RuntimeError(f"rank 0 cannot listen on port {port} for the rendezvous ({e}): choose a free "
                               "MASTER_PORT (or set FASTGPT_RDZV_PORT)") from e
        server.listen(world)
        conns, infos, error = [], {0: info}, None
        try:
            while len(conns) < world - 1:
                server.settimeout(left())
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, world)) - set(infos))
                    raise RuntimeError(f"rendezvous at {where} timed out after {timeout:g} s: ranks {missing} of "
                                       f"{world} never connected (were they started? same MASTER_ADDR/PORT?)")
                # A connection that is not a rank (a port scan, a health check, a peer that died mid-message)
                # is dropped: it must neither end the rendezvous nor hold it past the one it stalled.
                conn.settimeout(min(left(), 10.0))
                try:
                    head = _recv_msg(conn)
                except OSError:  # ConnectionError and socket.timeout among them
                    conn.close()
                    continue
                if not head.startswith(_MAGIC) or len(head) < len(_MAGIC) + 8:
                    conn.close()
                    continue
                conns.append(conn)
                r, w = struct.unpack("!II", head[len(_MAGIC):len(_MAGIC) + 8])
                if w != world:
                    error = f"rank {r} says WORLD_SIZE={w}, rank 0 says {world}: every rank must agree"
                elif r in infos or not 0 < r < world:
                    error = f"two processes claim rank {r} (or it is out of range for WORLD_SIZE={world})"
                if error:
                    break
                infos[r] = head[len(_MAGIC) + 8:]
            if error is None:
                error = _check_infos([infos[r] for r in range(world)])
            reply = b"E" + error.encode() if error else b"K" + payload
            for conn in conns:
                try:
                    _send_msg(conn, reply)
                except OSError:
                    pass
        finally:
            for conn in conns:
                conn.close()
            server.close()
        if error:
            raise RuntimeError(error)
        return payload

    while True:  # rank 0 may not be listening yet
        try:
            sock = socket.create_connection((addr, port), timeout=min(left(), 5.0))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"rank {rank} could not reach rank 0 at {where} within {timeout:g} s ({e}): "
                                   "check MASTER_ADDR/MASTER_PORT and that rank 0 is running") from e
            time.sleep(0.05)
    try:
        sock.settimeout(left())
        _send_msg(sock, _MAGIC + struct.pack("!II", rank, world) + info)
        reply = _recv_msg(sock)
    except (socket.timeout, ConnectionError) as e:
        raise RuntimeError(f"rank {rank}: rendezvous at {where} gave no answer within {timeout:g} s ({e}): "
                           "some rank never arrived or failed") from e
    finally:
        sock.close()
    if reply[:1] == b"E":
        raise RuntimeError(reply[1:].decode())
    return reply[1:]
