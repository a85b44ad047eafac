"""CUDA-IPC weight sync, the parts a CPU can check: the request bodies the real sender builds, parsed by the
installed vLLM's own ipc engine parser and unpacked by its own `unpack_tensor`; the whole sync protocol against a
stand-in server (buckets, lifetimes, a server dying mid-transfer); the transfer choice; the one-GPU memory plan.
The CUDA part (real IPC handles into a second process, a real vLLM server) is tests/test_gpu_ipc.py."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch

import grpo.ipc_transfer as ipc
from grpo.ipc_transfer import (OneGpuMemoryError, OneGpuMemoryPlan, ServerView, choose_transfer, is_loopback,
                               plan_buckets, same_gpu, server_visible_device)
from grpo.send_plan import build_plan
from grpo.weight_sync import WeightSync, WeightSyncConfig, WeightSyncError

from fake_vllm import DROP, FakeVLLM, Reply, get_routes, server_info_payload

GIB = 2**30


# ---- a CPU stand-in for CUDA IPC handles ------------------------------------------------------------------------
class FakeIpc:
    """`share_handle` for CPU tensors: the same 15 `rebuild_cuda_tensor` arguments torch's reduce_tensor returns
    (storage handle at 7, the device at 6, which vLLM overwrites), the storage found again by key through a weak
    reference (torch's own IPC storage cache does the same), so a buffer the trainer freed cannot be read."""

    def __init__(self):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.weak = StorageWeakRef
        self.storages: dict[bytes, object] = {}

    def share(self, tensor: torch.Tensor) -> tuple:
        storage = tensor.untyped_storage()
        key = str(storage.data_ptr()).encode()
        self.storages[key] = self.weak(storage)
        return (torch.Tensor, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), torch.UntypedStorage,
                tensor.dtype, 0, key, storage.nbytes(), 0, False, b"refcounter", 0, b"event", True)

    def rebuild(self, args) -> torch.Tensor:
        assert len(args) == 15, "rebuild_cuda_tensor takes 15 arguments"
        ref = self.storages[args[7]]
        assert not ref.expired(), "the trainer freed a buffer the server was still reading"
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        return torch.empty(0, dtype=args[5]).set_(storage, args[3], args[1], args[2])

    def alive(self) -> int:
        gc.collect()
        return sum(not ref.expired() for ref in self.storages.values())


def vllm_ipc_engine():
    """The installed vLLM's ipc engine, without a worker (its parsers need no device)."""
    engine_module = pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
    return object.__new__(engine_module.IPCWeightTransferEngine)


def unpack(update_info, fake: FakeIpc, uuid: str) -> dict[str, torch.Tensor]:
    """What vLLM's engine does with a parsed update (packed: `packed_ipc_consumer`, else per tensor), on CPU."""
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    dtypes = [getattr(torch, d) for d in update_info.dtype_names]
    if update_info.tensor_sizes is not None:
        packed = fake.rebuild(list(update_info.ipc_handles[uuid]))[:sum(update_info.tensor_sizes)]
        pairs = unpack_tensor(packed, update_info.names, update_info.shapes, dtypes, update_info.tensor_sizes)
        return {name: t.clone() for name, t in pairs}
    return {name: fake.rebuild(list(handle[uuid])).clone()
            for name, handle in zip(update_info.names, update_info.ipc_handles)}


def small_model(seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False)
    return tf.Qwen3ForCausalLM(cfg).eval()


# ---- the request body against vLLM's own parser ------------------------------------------------------------------
@pytest.mark.parametrize("layout", [ipc.PACKED, ipc.PER_TENSOR])
def test_update_info_is_what_vllms_ipc_engine_parses(monkeypatch, layout):
    engine = vllm_ipc_engine()
    fake = FakeIpc()
    monkeypatch.setattr(ipc, "share_handle", fake.share)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    plan = build_plan(small_model(), torch.bfloat16)
    packed = layout == ipc.PACKED
    channel = ipc.IpcChannel(control=None, layout=layout, uuid="8f2d-uuid", bucket_bytes=1 << 30, timeout=5,
                             device=None)
    manifest = plan.manifest
    dtypes = [getattr(torch, d) for d in manifest["dtype_names"]]
    sizes = [t.numel() * 2 for _, t in plan.iter_tensors()]
    indices = range(len(sizes))
    buffer, offsets = channel._fill(plan.iter_tensors(), manifest, indices, sizes, dtypes)
    body = json.loads(json.dumps({"update_info": channel._update_info(buffer, offsets, manifest, indices, sizes,
                                                                       dtypes)}))["update_info"]  # over HTTP
    assert ("tensor_sizes" in body) == packed and "ipc_handles" not in body and "packed" not in body
    parsed = engine.parse_update_info(body)
    assert parsed.names == manifest["names"] and parsed.dtype_names == manifest["dtype_names"]
    assert parsed.shapes == manifest["shapes"]
    handles = [parsed.ipc_handles] if packed else parsed.ipc_handles
    assert all(list(h) == ["8f2d-uuid"] and len(h["8f2d-uuid"]) == 15 for h in handles)
    received = unpack(parsed, fake, "8f2d-uuid")
    for name, tensor in plan.iter_tensors():
        assert received[name].dtype == torch.bfloat16 and torch.equal(received[name], tensor), name
    # the engine's init parser takes the layout flag of the packed layout
    assert engine.parse_init_info({"packed": True}).packed is True and engine.parse_init_info({}).packed is False


def test_fill_casts_uncast_sources_and_misaligned_slots_byte_for_byte():
    """The sync fills buckets from the plan's uncast tensors (cast=False): the bytes must be those of the cast
    ones; a packed bucket can put a tensor where its dtype cannot view (odd bf16 size before a float32)."""
    plan = build_plan(small_model(), torch.bfloat16)
    manifest = plan.manifest
    dtypes = [getattr(torch, d) for d in manifest["dtype_names"]]
    sizes = [t.numel() * 2 for _, t in plan.iter_tensors()]
    channel = ipc.IpcChannel(control=None, layout=ipc.PACKED, uuid="u", bucket_bytes=1 << 30, timeout=5, device=None)
    indices = range(len(sizes))
    cast, _ = channel._fill(plan.iter_tensors(), manifest, indices, sizes, dtypes)
    uncast, _ = channel._fill(plan.iter_tensors(cast=False), manifest, indices, sizes, dtypes)
    assert any(t.dtype == torch.float32 for _, t in plan.iter_tensors(cast=False))  # the cast is really the fill's
    assert torch.equal(cast, uncast)
    odd = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[3], [2, 2]]}
    a, b = torch.randn(3), torch.randn(2, 2)
    buffer, offsets = channel._fill(iter([("a", a), ("b", b)]), odd, range(2), [6, 16], [torch.bfloat16, torch.float32])
    assert offsets == [0, 6]
    assert torch.equal(buffer[:6].view(torch.bfloat16), a.to(torch.bfloat16)) and torch.equal(
        buffer[6:].clone().view(torch.float32).view(2, 2), b)
    with pytest.raises(ValueError, match="disagrees with the manifest at entry 1"):
        channel._fill(iter([("a", a), ("c", b)]), odd, range(2), [6, 16], [torch.bfloat16, torch.float32])


def test_vllm_refuses_pickled_handles_without_the_insecure_switch(monkeypatch):
    engine = vllm_ipc_engine()
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    body = ipc.packed_update_info(["w"], ["bfloat16"], [[2]], [4], {"u": (1,)})
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        engine.parse_update_info(body)


def test_buckets_hold_whole_groups_in_order():
    assert plan_buckets([10, 10, 10, 10], 25) == [range(0, 2), range(2, 4)]
    assert plan_buckets([30, 5, 5, 40, 1], 25) == [range(0, 1), range(1, 3), range(3, 4), range(4, 5)]
    assert plan_buckets([5, 5], 100) == [range(0, 2)] and plan_buckets([], 10) == []


# ---- the protocol against a stand-in server ----------------------------------------------------------------------
class StandInServer:
    """The routes WeightSync calls on a vLLM server with the ipc backend, in a thread. Parses every update with
    vLLM's own parser and rebuilds it through FakeIpc; `old_engine` answers an init carrying `packed` the way an
    engine whose init_info has no such field does, and then either takes `packed` in each update
    (`old_engine="per update"`, as vLLM 0.26's engine) or refuses it there too (`"per tensor"`, answering as vLLM's
    worker does: a 500 naming the field); `die_on` / `hang_on` break the n-th update."""

    def __init__(self, fake: FakeIpc, old_engine=None, die_on=None, hang_on=None, backend="ipc"):
        self.fake, self.old_engine, self.die_on, self.hang_on = fake, old_engine, die_on, hang_on
        self.layouts = []  # per update: "packed" (one handle) or "per tensor"
        self.engine = vllm_ipc_engine()
        self.calls, self.received, self.alive_at_update, self.init_infos = [], {}, [], []
        self.pause_queries = []  # the query string of each /pause
        self.info = server_info_payload(backend=backend, gpu_memory_utilization=0.3, insecure_serialization=True,
                                env_vars="VLLM_SERVER_DEV_MODE=1\nCUDA_VISIBLE_DEVICES=0\n")
        self.http = FakeVLLM(get_routes(self.info) | {
            "/init_weight_transfer_engine": self.init_engine, "/update_weights": self.update_weights,
            "/finish_weight_update": lambda r: self.called(f"finish:{r.body.get('weight_version')}"),
            "/pause": lambda r: self.pause_queries.append(r.query) or self.called("pause"),
            "/start_weight_update": lambda r: self.called("start"), "/resume": lambda r: self.called("resume"),
        }, fallback=lambda r: self.called(r.route.lstrip("/")) if r.method == "POST" else {}).start()
        self.base_url = self.http.base_url

    def called(self, name: str) -> dict:
        self.calls.append(name)
        return {}

    def init_engine(self, request) -> dict | Reply:
        self.init_infos.append(request.body["init_info"])
        if self.old_engine and "packed" in request.body["init_info"]:
            return Reply({"error": {"message": "Call to collective_rpc method failed: Worker failed with error "
                                    "'Invalid init_info for IPCWeightTransferEngine: IPCWeightTransferInitInfo."
                                    "__init__() got an unexpected keyword argument 'packed''"}}, 500)
        return {}

    def update_weights(self, request):
        n = sum(c == "update" for c in self.calls) + 1
        if n == self.die_on:
            return DROP  # the server process dies mid-request
        if n == self.hang_on:
            time.sleep(30)
        info = dict(request.body["update_info"])
        if info.pop("packed", None) is not None and self.old_engine != "per update":
            return Reply({"error": {"message": "Call to collective_rpc method failed: Invalid update_info for "
                                    "IPCWeightTransferEngine: IPCWeightTransferUpdateInfo.__init__() got an "
                                    "unexpected keyword argument 'packed'"}}, 500)
        self.alive_at_update.append(self.fake.alive())
        parsed = self.engine.parse_update_info(info)
        self.layouts.append("packed" if parsed.tensor_sizes is not None else "per tensor")
        self.received.update(unpack(parsed, self.fake, "cpu"))
        return self.called("update")

    def stop(self):
        self.http.stop()


@pytest.fixture
def fake_ipc(monkeypatch):
    fake = FakeIpc()
    monkeypatch.setattr(ipc, "share_handle", fake.share)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # `alive` collects garbage inside a request the sync times out after 2 s: with vLLM and torch imported a full
    # collection took 1.6-2 s on a loaded 2-core machine. What exists before the test is not what it counts.
    gc.freeze()
    yield fake
    gc.unfreeze()


@pytest.mark.parametrize("old_engine", [None, "per update", "per tensor"], ids=["packed", "packed_per_update",
                                                                             "per_tensor"])
def test_ipc_sync_sends_every_weight_in_buckets_one_alive_at_a_time(fake_ipc, old_engine):
    server = StandInServer(fake_ipc, old_engine=old_engine)
    try:
        model = small_model()
        sync = WeightSync(server.base_url, WeightSyncConfig(mode="ipc", timeout=10, ipc_bucket_bytes=40_000))
        sync.init(model)
        assert sync.mode == "ipc"
        assert server.init_infos == ([{"packed": True}, {}] if old_engine else [{"packed": True}])
        expected = dict(sync.plan.iter_tensors())
        for version in (5, 6):  # the second sync keeps the layout the first one found
            server.calls.clear(), server.received.clear(), server.alive_at_update.clear(), server.layouts.clear()
            timings = sync.sync(model, version=version)
            buckets = len(server.layouts)
            assert buckets >= 4  # 3 layers + embeddings + head in 40 kB buckets
            assert server.layouts == ["per tensor" if old_engine == "per tensor" else "packed"] * buckets
            assert sync.ipc.layout == {None: ipc.PACKED, "per update": ipc.PACKED_PER_UPDATE,
                                       "per tensor": ipc.PER_TENSOR}[old_engine]
            refused = old_engine == "per tensor" and version == 5  # the first bucket, once, then again per tensor
            assert server.calls == ["pause", "start", *["update"] * buckets, f"finish:{version}", "resume"]
            assert server.alive_at_update == [1 + refused] + [1] * (buckets - 1)  # + the refused bucket's buffer
            assert list(server.received) == list(expected)
            for name, tensor in expected.items():
                assert torch.equal(server.received[name], tensor), name
            assert timings["perf/weight_sync_transfer_s"] > 0
            assert timings["perf/weight_sync_update_s"] > 0 and timings["perf/weight_sync_fill_s"] > 0
        sync.close()
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_server_failing_mid_transfer_raises_within_the_timeout(fake_ipc, how):
    server = StandInServer(fake_ipc, **({"die_on": 2} if how == "dies" else {"hang_on": 2}))
    try:
        model = small_model()
        sync = WeightSync(server.base_url, WeightSyncConfig(mode="ipc", timeout=2.0, ipc_bucket_bytes=40_000))
        sync.init(model)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="restart it"):
            sync.sync(model, version=1)
        assert time.monotonic() - start < 8.0  # the 2 s call timeout (+ the best-effort finish), not 30 s
        assert server.calls[:3] == ["pause", "start", "update"]
    finally:
        server.stop()


def test_ipc_refuses_a_non_loopback_server_before_any_request():
    with pytest.raises(ValueError, match="127.0.0.1"):
        WeightSync("http://10.1.2.3:8000", WeightSyncConfig(mode="ipc"))
    with pytest.raises(ValueError, match="one vLLM server"):
        WeightSync(["http://127.0.0.1:8000", "http://127.0.0.1:8001"], WeightSyncConfig(mode="ipc"))
    assert is_loopback("http://localhost:8000") and is_loopback("http://127.0.0.5:1") and is_loopback("http://[::1]:8")
    assert not is_loopback("http://gen1:8000") and not is_loopback("http://0.0.0.0:8000")


def test_ipc_refuses_a_server_started_for_another_backend(fake_ipc):
    server = StandInServer(fake_ipc, backend="nccl")
    try:
        with pytest.raises(ValueError, match='"backend": "ipc"'):
            WeightSync(server.base_url, WeightSyncConfig(mode="ipc", timeout=5)).init(small_model())
    finally:
        server.stop()


# ---- which transfer, on which GPU ----------------------------------------------------------------------------
def server_info(cvd: str | None = "0", backend: str | None = "ipc") -> dict:
    env = "VLLM_SERVER_DEV_MODE=1\n" + (f"CUDA_VISIBLE_DEVICES={cvd}\n" if cvd is not None else "")
    info = {"vllm_config": {"weight_transfer_config": {"backend": backend} if backend else None},
            "system_env": {"env_vars": env}}
    return info


UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000"]


def test_server_gpu_is_read_from_its_reported_environment():
    assert server_visible_device(server_info("1,0")) == "1"
    assert server_visible_device(server_info(None)) == "0"  # unset: the first GPU
    assert server_visible_device({"vllm_config": {}}) is None  # /server_info without system_env: unknown
    url = "http://127.0.0.1:8000"
    assert same_gpu(server_info("1"), url, "bbbb2222-0000", "1", UUIDS)[0] is True
    assert same_gpu(server_info("0"), url, "bbbb2222-0000", "1", UUIDS)[0] is False
    assert same_gpu(server_info("GPU-bbbb2222"), url, "bbbb2222-0000", "0", [])[0] is True  # a UUID prefix
    assert same_gpu(server_info("0"), url, "aaaa1111-0000", "0", [])[0] is True  # no NVML: same name, same host
    assert same_gpu(server_info("0"), "http://gen1:8000", "aaaa1111-0000", "0", [])[0] is None  # other host?
    assert same_gpu({"vllm_config": {"device_config": {"device": "cpu"}}}, url, "a", "0", UUIDS)[0] is False


def view(same=True, backend="ipc", world=1, url="http://127.0.0.1:8000"):
    return ServerView(url, backend, world, same, "GPU-x")


def test_auto_picks_ipc_only_for_one_same_gpu_server_and_says_why():
    assert choose_transfer("auto", True, [view()]).mode == "ipc"
    assert choose_transfer("auto", True, [view(backend=None)]).mode == "ipc"
    assert choose_transfer("auto", True, [view(same=None)]).mode == "ipc"  # started for ipc: the engine checks
    for same in (True, None):  # vLLM's IPC receiver loading in place takes the same updates
        assert choose_transfer("auto", True, [view(same=same, backend="ipc_inplace")]).mode == "ipc"
    assert choose_transfer("ipc", True, [view(backend="ipc_inplace")]).mode == "ipc"
    assert choose_transfer("auto", True, [view(same=False, backend="nccl")]).mode == "nccl"
    assert choose_transfer("auto", True, [view(same=None, backend=None)]).mode == "nccl"
    assert choose_transfer("auto", True, [view(backend="cpu_file")]).mode == "cpu_file"
    assert choose_transfer("auto", False, [view()]).mode == "cpu_file"
    assert choose_transfer("nccl", True, [view()]).mode == "nccl"
    assert "this trainer's GPU" in choose_transfer("auto", True, [view()]).reason
    for same in (True, None):  # vLLM's reloading `ipc` engine: the log names the faster in-place backend, once
        assert "'ipc_inplace'" in choose_transfer("auto", True, [view(same=same)]).reason
        assert "'ipc_inplace'" not in choose_transfer("auto", True, [view(same=same, backend="ipc_inplace")]).reason
    with pytest.raises(ValueError, match="NCCL cannot put two ranks on one GPU"):
        choose_transfer("auto", True, [view(backend="nccl")])
    with pytest.raises(ValueError, match="is not"):
        choose_transfer("ipc", True, [view(same=False)])
    with pytest.raises(ValueError, match="one vLLM worker"):
        choose_transfer("ipc", True, [view(world=2)])
    with pytest.raises(ValueError, match="127.0.0.1"):
        choose_transfer("auto", True, [view(url="http://gen1:8000")])


# ---- one-GPU memory plan ---------------------------------------------------------------------------------------
def test_memory_plan_fits_or_names_both_numbers():
    OneGpuMemoryPlan(140 * GIB, 0.3, 60 * GIB, 1 * GIB).check()
    plan = OneGpuMemoryPlan(140 * GIB, 0.5, 90 * GIB, 1 * GIB)
    with pytest.raises(OneGpuMemoryError) as err:
        plan.check()
    text = str(err.value)
    assert "gpu_memory_utilization 0.50" in text and "70.0 GiB" in text  # the server's share
    assert "measured peak 90.0 GiB" in text and "92.0 GiB" in text  # the trainer's
    assert f"--gpu-memory-utilization {plan.max_server_fraction:.2f}" in text
    OneGpuMemoryPlan(140 * GIB, plan.max_server_fraction, 90 * GIB, 1 * GIB).check()  # the advice fits
    with pytest.raises(OneGpuMemoryError, match="does not fit beside any server"):
        OneGpuMemoryPlan(80 * GIB, 0.1, 80 * GIB, 0).check()


def test_memory_plan_reads_the_servers_share():
    assert ipc.server_fraction({"vllm_config": {"cache_config": {"gpu_memory_utilization": 0.3}}}) == 0.3
    assert ipc.server_fraction({"vllm_config": {"cache_config": {"gpu_memory_utilization": 0.9,
                                                                 "kv_cache_memory_bytes": 1 << 30}}}) is None


def test_ipc_errors_name_the_fix():
    from grpo.vllm_client import error_hint

    assert "CUDA_VISIBLE_DEVICES" in error_hint(500, "/update_weights", "IPC handle not found for GPU UUID abc. "
                                                "Available UUIDs: ['def']")
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION=1" in error_hint(
        500, "/update_weights", "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1")


def test_ipc_bucket_size_is_a_run_option(fake_ipc):
    """--ipc-bucket-mb reaches the sender: 1 MiB buckets on a model of a few MiB send several buckets, 64 MiB one."""
    from grpo.config import AsyncGRPOConfig
    from grpo.server_facts import sync_config

    from grpo.inputs import check_config_values

    with pytest.raises(ValueError, match="--ipc-bucket-mb 0"):
        check_config_values(AsyncGRPOConfig(model="m", ipc_bucket_mb=0))
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                               vocab_size=2048, tie_word_embeddings=False)).eval()
    counts = {}
    for mb in (1, 64):
        server = StandInServer(fake_ipc)
        try:
            config = AsyncGRPOConfig(model="m", weight_transfer="ipc", ipc_bucket_mb=mb, vllm_server_timeout=10)
            sync = WeightSync(server.base_url, sync_config(config))
            sync.init(model)
            sync.sync(model, version=1)
            counts[mb] = len(server.layouts)
            assert list(server.received) == [n for n, _ in sync.plan.iter_tensors()]
            sync.close()
        finally:
            server.stop()
    assert counts[64] == 1 < counts[1], counts


@pytest.mark.parametrize("keep", [False, True])
def test_sync_pauses_with_clear_cache_false_only_when_asked(fake_ipc, keep):
    """`sync_keeps_kv_cache` sends /pause?mode=keep&clear_cache=false; by default only mode=keep (vLLM's default
    clear_cache=true: the running requests re-prefill after the sync)."""
    from grpo.config import AsyncGRPOConfig
    from grpo.server_facts import sync_config
    from grpo.weight_sync import WeightSync

    server = StandInServer(fake_ipc)
    try:
        config = AsyncGRPOConfig(model="m", weight_transfer="ipc", vllm_server_timeout=10, sync_keeps_kv_cache=keep)
        sync = WeightSync(server.base_url, sync_config(config))
        sync.init(small_model(seed=1))
        sync.sync(small_model(seed=1), version=1)
        sync.close()
    finally:
        server.stop()
    assert server.pause_queries == ["mode=keep&clear_cache=false" if keep else "mode=keep"]


def _one_rank_fsdp_plan(rank: int, init_file: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        model = small_model(seed=3)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        plan = build_plan(model, torch.bfloat16)
        assert plan.has_dtensors
        DTensor.full_tensor = None  # a one-process mesh holds every tensor whole: no gather may be needed
        torch.save({"cast": dict(plan.iter_tensors()), "uncast": dict(plan.iter_tensors(cast=False))}, out)
    finally:
        torch.distributed.destroy_process_group()


def test_one_process_fsdp2_plan_reads_local_shards_equal_to_the_plain_model(tmp_path):
    """World 1 FSDP2 (the one-GPU trainer): the plan yields the unsharded model's tensors without a gather."""
    import torch.multiprocessing as mp

    mp.spawn(_one_rank_fsdp_plan, args=(str(tmp_path / "init"), str(tmp_path / "out.pt")), nprocs=1, join=True)
    got = torch.load(tmp_path / "out.pt")
    want = build_plan(small_model(seed=3), torch.bfloat16)
    assert list(got["cast"]) == [n for n, _ in want.iter_tensors()]
    for name, tensor in want.iter_tensors(cast=False):
        assert torch.equal(got["uncast"][name], tensor) and got["uncast"][name].dtype == torch.float32, name
        assert torch.equal(got["cast"][name], tensor.to(torch.bfloat16)), name


def test_plugin_registers_the_in_place_ipc_receiver(monkeypatch):
    """`ipc_inplace` is vLLM's IPC engine (its parsing and receive path inherited) without layerwise reload: the
    factory builds it by name, start/finish leave the model alone, and a quantized model is refused by name."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    from grpo.vllm_plugin import register

    register()
    register()  # idempotent
    engine_cls = WeightTransferEngineFactory._registry["ipc_inplace"]()
    assert issubclass(engine_cls, IPCWeightTransferEngine)
    assert engine_cls.receive_weights.__qualname__.startswith("InPlaceIPCWeightTransferEngine")
    assert engine_cls.parse_update_info is IPCWeightTransferEngine.parse_update_info
    engine = engine_cls.__new__(engine_cls)
    engine.model_config = type("ModelConfig", (), {"quantization": None})()
    with pytest.raises(ValueError, match="backend 'cpu_file'"):  # this machine's vLLM is the CPU build
        engine.start_weight_update()
    from vllm.platforms import current_platform

    with monkeypatch.context() as patch:  # as on a GPU server
        patch.setattr(current_platform, "is_cpu", lambda: False)
        engine.start_weight_update()
        engine.finish_weight_update()
        engine.model_config.quantization = "fp8"
        with pytest.raises(ValueError, match="serve with backend 'ipc'"):
            engine.start_weight_update()


@pytest.mark.parametrize("backend", ["ipc", "ipc_inplace"])
def test_serve_command_for_ipc_backends_is_loopback_with_the_serialization_switch(backend):
    from grpo.vllm_server import ServeConfig, serve_command

    argv, env = serve_command(ServeConfig(model="m", weight_transfer_backend=backend))
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": backend}
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and argv[argv.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(ValueError, match="127.0.0.1"):
        serve_command(ServeConfig(model="m", host="0.0.0.0", weight_transfer_backend=backend))
    _, env = serve_command(ServeConfig(model="m", host="0.0.0.0", weight_transfer_backend="nccl"))
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env
