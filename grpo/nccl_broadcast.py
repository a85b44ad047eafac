"""The trainer's end of vLLM's NCCL weight-transfer wire, in plain torch + ctypes (vLLM is not imported).

vLLM's workers (vllm/distributed/weight_transfer/nccl_common.py, packed_tensor.py, v0.32) join a group this way,
and this module does the same from the trainer (rank 0), byte for byte:
  1. rendezvous: a `torch.distributed.TCPStore` hosted by rank 0 (`world_size` clients, `use_libuv=False`);
     rank 0 calls `ncclGetUniqueId` and stores the *pickled vLLM `ncclUniqueId`* under `broadcast_from/0/0`
     (the first `StatelessProcessGroup.broadcast_obj`); every rank `ncclCommInitRank(world, uid, rank)`;
  2. warm-up: a one-element float32 sum all_reduce on every rank before any other collective;
  3. data: packed uint8 broadcasts from rank 0. A chunk takes tensors until its byte count *exceeds* the buffer
     size (so it overshoots by at most one tensor); chunks rotate over `num_buffers` CUDA streams.
torch's own ProcessGroupNCCL keeps its unique id under private store keys, so it cannot join vLLM's group; the
communicator is a direct ctypes binding of the libnccl torch already loaded (what vLLM's PyNccl does too).

Every wait has a deadline: a stuck peer aborts the communicator and raises instead of hanging (TRL #6796).
"""

from __future__ import annotations

import ctypes
import math
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta

import torch

UNIQUE_ID_BYTES = 128
UNIQUE_ID_STORE_KEY = "broadcast_from/0/0"
VLLM_UNIQUE_ID_CLASS = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
_NCCL_UINT8, _NCCL_FLOAT32, _NCCL_SUM = 1, 7, 0


def nccl_rank_offsets(world_sizes: Sequence[int]) -> tuple[list[int], int]:
    """One NCCL group spanning the trainer (rank 0, the only sender) and every server's workers: server i's
    workers start at 1 + the workers of the servers before it. Returns (rank_offset per server, group size)."""
    offsets, next_rank = [], 1
    for size in world_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def pickle_unique_id(raw: bytes) -> bytes:
    """The pickle vLLM's worker `pickle.loads` into its own `ncclUniqueId` (a ctypes struct: `_ctypes._unpickle`
    of the class and `({}, raw bytes)`), written without importing vLLM."""
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    module, name = VLLM_UNIQUE_ID_CLASS
    return (b"\x80\x03" + b"c_ctypes\n_unpickle\n" + f"c{module}\n{name}\n".encode() + b"}"
            + b"B" + struct.pack("<I", len(raw)) + raw + b"\x86\x86R.")


def unpickle_unique_id(data: bytes) -> bytes:
    """The raw bytes of a pickled vLLM `ncclUniqueId`, without vLLM (the receiver of scripts/bench_weight_sync.py)."""

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) == ("_ctypes", "_unpickle"):
                return lambda _cls, state: bytes(state[1])
            if (module, name) == VLLM_UNIQUE_ID_CLASS:
                return None
            raise pickle.UnpicklingError(f"unexpected global {module}.{name} in an NCCL unique id")

    import io

    raw = _Restricted(io.BytesIO(data)).load()
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"unpickled NCCL unique id has {len(raw)} bytes, expected {UNIQUE_ID_BYTES}")
    return raw


def find_nccl_library() -> str:
    """`GRPO_NCCL_LIBRARY`, else the libnccl.so.2 a CUDA torch has loaded, else the nvidia-nccl wheel's copy."""
    if os.environ.get("GRPO_NCCL_LIBRARY"):
        return os.environ["GRPO_NCCL_LIBRARY"]
    try:
        import nvidia.nccl

        candidate = os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2")
        if os.path.exists(candidate):
            return candidate
    except ImportError:
        pass
    return "libnccl.so.2"


class NcclLibrary:
    """The five libnccl entry points the weight broadcast needs."""

    def __init__(self, path: str | None = None):
        path = path or find_nccl_library()
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as exc:
            raise RuntimeError(f"cannot load NCCL from {path!r} ({exc}); install a CUDA build of torch or set "
                               "GRPO_NCCL_LIBRARY=/path/to/libnccl.so.2") from exc
        p, i, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        self.lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        self.lib.ncclCommInitRank.argtypes = [ctypes.POINTER(p), i, _UniqueId, i]
        self.lib.ncclBroadcast.argtypes = [p, p, s, i, i, p, p]
        self.lib.ncclAllReduce.argtypes = [p, p, s, i, i, p, p]
        self.lib.ncclCommAbort.argtypes = [p]
        self.lib.ncclCommDestroy.argtypes = [p]

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"NCCL {what} failed: {self.lib.ncclGetErrorString(result).decode()} (code {result})")

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def init_rank(self, world_size: int, raw_uid: bytes, rank: int) -> ctypes.c_void_p:
        uid, comm = _UniqueId(), ctypes.c_void_p()
        ctypes.memmove(uid.internal, raw_uid, UNIQUE_ID_BYTES)
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        return comm


def wait_stream(stream: torch.cuda.Stream, deadline: float, on_timeout: Callable[[], None], what: str) -> None:
    """Poll instead of `synchronize()` so a dead peer becomes an error, not a hang."""
    while not stream.query():
        if time.monotonic() > deadline:
            on_timeout()
            raise TimeoutError(f"{what} did not complete before its deadline; the vLLM side is stuck or dead "
                               "(restart the server; raise vllm_server_timeout for very large models)")
        time.sleep(0.0005)


class NcclGroup:
    """One NCCL communicator on the current CUDA device, joined through vLLM's TCPStore rendezvous."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout: float = 600.0):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.nccl = NcclLibrary()
        self.store = torch.distributed.TCPStore(address, port, world_size=world_size, is_master=(rank == 0),
                                                timeout=timedelta(seconds=timeout), use_libuv=False)
        if rank == 0:
            raw_uid = self.nccl.unique_id()
            self.store.set(UNIQUE_ID_STORE_KEY, pickle_unique_id(raw_uid))
        else:
            raw_uid = unpickle_unique_id(self.store.get(UNIQUE_ID_STORE_KEY))
        self.comm = self._init_comm(raw_uid)
        warmup = torch.zeros(1, device=self.device)  # [1] float32, as PyNcclCommunicator._init_comm
        self.all_reduce_(warmup)
        self.synchronize(torch.cuda.current_stream(), "NCCL warm-up all_reduce")

    def _init_comm(self, raw_uid: bytes) -> ctypes.c_void_p:
        """`ncclCommInitRank` blocks until every rank joins: run it on a daemon thread with a deadline."""
        result: dict = {}

        def target():
            try:
                with torch.cuda.device(self.device):
                    result["comm"] = self.nccl.init_rank(self.world_size, raw_uid, self.rank)
            except BaseException as exc:  # surfaced below
                result["error"] = exc

        thread = threading.Thread(target=target, daemon=True, name="nccl-init")
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise TimeoutError(f"ncclCommInitRank (rank {self.rank} of {self.world_size}) did not finish in "
                               f"{self.timeout:.0f} s: a vLLM worker never joined the weight-transfer group")
        if "error" in result:
            raise result["error"]
        return result["comm"]

    def all_reduce_(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        stream = stream or torch.cuda.current_stream()
        self.nccl.check(self.nccl.lib.ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                                    _NCCL_FLOAT32, _NCCL_SUM, self.comm, stream.cuda_stream),
                        "ncclAllReduce")

    def broadcast_(self, tensor: torch.Tensor, src: int = 0, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue an in-place uint8 broadcast on `stream` (returns before it completes)."""
        assert tensor.dtype == torch.uint8 and tensor.is_contiguous() and tensor.device == self.device
        stream = stream or torch.cuda.current_stream()
        self.nccl.check(self.nccl.lib.ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                                    _NCCL_UINT8, src, self.comm, stream.cuda_stream),
                        "ncclBroadcast")

    def synchronize(self, stream: torch.cuda.Stream, what: str) -> None:
        wait_stream(stream, time.monotonic() + self.timeout, self.abort, what)

    def abort(self) -> None:
        if self.comm is not None:
            self.nccl.lib.ncclCommAbort(self.comm)
            self.comm = None

    def close(self) -> None:
        """Local teardown. ncclCommDestroy finalizes with the peers, and a vLLM worker keeps its communicator for
        the server's lifetime, so destroy would block forever (seen on 2xH200): finish our work, then abort."""
        if self.comm is not None:
            torch.cuda.synchronize()
            self.abort()


# ---- packing (the chunk rule both ends must share) --------------------------------------------------------------
def tensor_nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def chunk_boundaries(sizes: list[int], buffer_size_bytes: int) -> list[range]:
    """Index ranges of each chunk: add tensors until the running byte count exceeds the buffer size (vLLM's
    `pack_tensors` and `packed_nccl_broadcast_consumer` rule; a chunk overshoots by up to one tensor)."""
    chunks, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        total += size
        if total > buffer_size_bytes:
            chunks.append(range(start, index + 1))
            start, total = index + 1, 0
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


def packed_broadcast_send(group: NcclGroup, named_tensors: Iterator[tuple[str, torch.Tensor]],
                          manifest: dict, buffer_size_bytes: int, num_buffers: int,
                          drain_before_next: bool = False) -> int:
    """Rank 0's producer: pack `named_tensors` (which must follow `manifest` exactly: names, dtypes, shapes) into
    the chunks the receiver cuts from the manifest and broadcast each on its buffer's stream. Returns bytes sent.

    `drain_before_next`: finish every in-flight broadcast before pulling the next tensors, for sources whose
    iteration runs collectives on another communicator (FSDP2 `full_tensor()`): two NCCL communicators with
    kernels in flight on one GPU can deadlock each other (TRL #7103).
    """
    dtypes = [getattr(torch, d) for d in manifest["dtype_names"]]
    sizes = [tensor_nbytes(s, d) for s, d in zip(manifest["shapes"], dtypes)]
    streams = [torch.cuda.Stream(device=group.device) for _ in range(num_buffers)]
    in_flight: list[list[torch.Tensor]] = [[] for _ in range(num_buffers)]
    deadline = time.monotonic() + group.timeout
    sent = 0
    for chunk_index, indices in enumerate(chunk_boundaries(sizes, buffer_size_bytes)):
        slot = chunk_index % num_buffers
        for other in (range(num_buffers) if drain_before_next else (slot,)):
            wait_stream(streams[other], deadline, group.abort, "weight broadcast")
            in_flight[other] = []
        flat = [_checked_flat(next(named_tensors, None), manifest, i, dtypes[i]).to(group.device) for i in indices]
        streams[slot].wait_stream(torch.cuda.current_stream())  # tensors were made on the current stream
        with torch.cuda.stream(streams[slot]):
            packed = torch.cat(flat) if len(flat) > 1 else flat[0]  # [sum of sizes] uint8
            group.broadcast_(packed, src=0, stream=streams[slot])
        in_flight[slot] = flat + [packed]
        sent += packed.numel()
    leftover = next(named_tensors, None)
    if leftover is not None:
        raise ValueError(f"weight source yielded {leftover[0]!r} beyond the {len(sizes)} manifest entries")
    for stream in streams:
        wait_stream(stream, deadline, group.abort, "weight broadcast")
    return sent


def checked_entry(item: tuple[str, torch.Tensor] | None, manifest: dict, index: int,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor, after checking it is the manifest's entry `index` by name, shape and (when given) dtype: a
    divergence would make the two ends cut chunks differently, a hang or garbage weights."""
    name, shape = manifest["names"][index], tuple(manifest["shapes"][index])
    if item is None:
        raise ValueError(f"weight source ended at manifest entry {index} ({name!r}); the server waits for the rest")
    got_name, tensor = item
    if got_name != name or (dtype is not None and tensor.dtype != dtype) or tuple(tensor.shape) != shape:
        declared = f"{name!r} {shape}" if dtype is None else f"{name!r} {dtype} {shape}"
        raise ValueError(f"weight source disagrees with the manifest at entry {index}: declared {declared}, "
                         f"got {got_name!r} {tensor.dtype} {tuple(tensor.shape)}")
    return tensor


def _checked_flat(item: tuple[str, torch.Tensor] | None, manifest: dict, index: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The checked tensor (`checked_entry`) as flat uint8."""
    return checked_entry(item, manifest, index, dtype).contiguous().view(-1).view(torch.uint8)


def packed_broadcast_receive(group: NcclGroup, manifest: dict, buffer_size_bytes: int, num_buffers: int,
                             on_chunk: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
    """A receiver that cuts and unpacks chunks as vLLM's `packed_nccl_broadcast_consumer` does (benchmarks and
    GPU tests; the real receiver is the vLLM worker). Returns bytes received."""
    dtypes = [getattr(torch, d) for d in manifest["dtype_names"]]
    sizes = [tensor_nbytes(s, d) for s, d in zip(manifest["shapes"], dtypes)]
    streams = [torch.cuda.Stream(device=group.device) for _ in range(num_buffers)]
    deadline = time.monotonic() + group.timeout
    received = 0
    for chunk_index, indices in enumerate(chunk_boundaries(sizes, buffer_size_bytes)):
        slot = chunk_index % num_buffers
        wait_stream(streams[slot], deadline, group.abort, "weight receive")
        with torch.cuda.stream(streams[slot]):
            packed = torch.empty(sum(sizes[i] for i in indices), dtype=torch.uint8, device=group.device)
            group.broadcast_(packed, src=0, stream=streams[slot])
            pieces = packed.split([sizes[i] for i in indices])
            on_chunk([(manifest["names"][i], piece.view(dtypes[i]).view(manifest["shapes"][i]))
                      for i, piece in zip(indices, pieces)])
        received += packed.numel()
    for stream in streams:
        wait_stream(stream, deadline, group.abort, "weight receive")
    return received
