"""Weight sync against references: checkpoint keys written by transformers' `save_pretrained`, vLLM's own pickle
and packing code, and a real vLLM CPU server whose logprobs must equal a float32 transformers forward of the
trainer's model after a sync (and differ from before it)."""

from __future__ import annotations

import logging
import os
import pickle
import time
from pathlib import Path

import httpx
import pytest
import torch

from grpo.nccl_broadcast import chunk_boundaries, pickle_unique_id, unpickle_unique_id
from grpo.weight_sync import WeightSync, WeightSyncConfig, WeightSyncError, build_plan, checkpoint_name

from fake_vllm import wait_until_up

TOKENS = [5, 77, 301, 12, 900, 45, 6, 250, 511, 33, 64, 128]
CPU_FILE = WeightSyncConfig(mode="cpu_file", timeout=120.0)


def load_model(model_dir: Path):
    import transformers as tf

    if "qwen3_5" in str(model_dir):
        return tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def perturbed(model_dir: Path, seed: int, scale: float = 0.05):
    """The checkpoint's model with every tensor changed (so a partial update cannot pass)."""
    model = load_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """float32 transformers log-softmax of each token given its prefix: [len(tokens) - 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()  # [T, V]
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def server_prompt_logprobs(base_url: str, model_name: str, tokens: list[int]) -> torch.Tensor:
    """Test-only: the server's logprob of each prompt token given its prefix (no prefix-cache read): [T - 1]."""
    body = {"model": model_name, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    entries = response.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entry[str(tok)]["logprob"] for entry, tok in zip(entries, tokens[1:])])


def server_sampled(base_url: str, model_name: str, tokens: list[int], n: int = 6) -> tuple[list[int], torch.Tensor]:
    """Test-only: sampled ids and their logprobs (these read the prefix cache): ([n], [n])."""
    body = {"model": model_name, "prompt": tokens, "max_tokens": n, "logprobs": 0, "temperature": 1.0, "seed": 3,
            "return_token_ids": True, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])


def assert_server_serves(server, model_dir: Path, model) -> None:
    name = str(model_dir)
    expected = reference_logprobs(model, TOKENS)
    torch.testing.assert_close(server_prompt_logprobs(server.base_url, name, TOKENS), expected, atol=1e-4, rtol=0)
    ids, sampled = server_sampled(server.base_url, name, TOKENS)
    expected_sampled = reference_logprobs(model, TOKENS + ids)[len(TOKENS) - 1:]
    torch.testing.assert_close(sampled, expected_sampled, atol=1e-4, rtol=0)


# ---- pure: names, shapes, values, wire format ---------------------------------------------------------------------
def test_checkpoint_name_strips_wrappers():
    assert checkpoint_name("module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight") == \
        "model.layers.1.self_attn.q_proj.weight"
    assert checkpoint_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_5"])
@pytest.mark.parametrize("origin", ["from_pretrained", "from_config"])
def test_plan_matches_saved_checkpoint(tiny_models, kind, origin):
    """Manifest names/shapes = the safetensors keys save_pretrained wrote (MoE experts unfused), values equal."""
    import transformers as tf
    from safetensors import safe_open

    model = load_model(tiny_models[kind])
    if origin == "from_config":
        model = type(model)(model.config)
        model.load_state_dict(load_model(tiny_models[kind]).state_dict())
    plan = build_plan(model, torch.bfloat16)
    manifest = plan.manifest
    with safe_open(tiny_models[kind] / "model.safetensors", "pt") as f:
        saved = {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
        assert dict(zip(manifest["names"], manifest["shapes"])) == saved
        assert set(manifest["dtype_names"]) == {"bfloat16"}
        for name, tensor in plan.iter_tensors():
            assert torch.equal(tensor, f.get_tensor(name).to(torch.bfloat16)), name
    assert isinstance(model, tf.PreTrainedModel)


def test_frozen_params_are_not_sent(tiny_models):
    model = load_model(tiny_models["qwen3_5"])
    for name, param in model.named_parameters():
        param.requires_grad_("visual" not in name)
    names = build_plan(model).manifest["names"]
    assert names and not any("visual" in n for n in names)
    assert len(names) == sum(1 for n, p in model.named_parameters() if p.requires_grad)


def test_unique_id_pickle_is_vllms():
    """vLLM's worker unpickles our rendezvous blob into its own ncclUniqueId with the same 128 bytes."""
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    raw = os.urandom(128)
    theirs = pickle.loads(pickle_unique_id(raw))
    assert isinstance(theirs, ncclUniqueId) and bytes(theirs.internal) == raw
    assert unpickle_unique_id(pickle.dumps(theirs)) == raw


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_chunk_boundaries_match_vllm_packer():
    """Our chunk cut (used by sender and receiver) equals vLLM's pack_tensors on the same tensors."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 400, (60,), generator=generator).tolist() + [900, 3, 1000, 1]
    tensors = [(f"t{i}", torch.zeros(s, dtype=torch.uint8)) for i, s in enumerate(sizes)]
    for buffer_size in (1, 250, 1000, 5000, 10**6):
        iterator, theirs = iter(tensors), []
        while (chunk := pack_tensors(iterator, lambda item: item[1], buffer_size)) is not None:
            theirs.append([int(n[1:]) for n in chunk.names])
        assert [list(r) for r in chunk_boundaries(sizes, buffer_size)] == theirs


# ---- real vLLM CPU server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_server(scratch_server):
    """These tests replace the server's weights: the shared server, lent and restored at the module's end."""
    return scratch_server


@pytest.mark.vllm
def test_sync_replaces_weights_and_flushes_prefix_cache(qwen3_server, tiny_qwen3):
    original = load_model(tiny_qwen3)
    assert_server_serves(qwen3_server, tiny_qwen3, original)  # also fills the prefix cache with the old weights
    before = server_prompt_logprobs(qwen3_server.base_url, str(tiny_qwen3), TOKENS)

    trainer_model = perturbed(tiny_qwen3, seed=1)
    sync = WeightSync(qwen3_server.base_url, CPU_FILE)
    sync.init(trainer_model)
    timings = sync.sync(trainer_model, version=7)
    assert set(timings) == {"perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s",
                            "perf/weight_sync_transfer_s"}
    assert timings["perf/weight_sync_s"] >= timings["perf/weight_sync_transfer_s"] > 0
    assert sync.control.weight_info() == "7"
    assert not sync.control.is_paused()
    assert_server_serves(qwen3_server, tiny_qwen3, trainer_model)  # same prompt again: no stale KV
    after = server_prompt_logprobs(qwen3_server.base_url, str(tiny_qwen3), TOKENS)
    assert (after - before).abs().max() > 0.05
    sync.close()


def _fsdp_worker(rank: int, base_url: str, model_dir: str, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = perturbed(Path(model_dir), seed=2)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sync = WeightSync(base_url, CPU_FILE)
        assert (sync.control is None) == (rank != 0), "only rank 0 may talk to the server"
        sync.init(model)
        assert sync.plan.has_dtensors
        timings = sync.sync(model, version=11)
        torch.save(timings, f"{out_dir}/timings_{rank}.pt")
        sync.close()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.vllm
def test_two_process_fsdp2_sync(qwen3_server, tiny_qwen3, tmp_path):
    """World 2 (gloo, FSDP2 fully_shard on CPU): every rank gathers, only rank 0 sends, server == full model."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(qwen3_server.base_url, str(tiny_qwen3), str(tmp_path / "init"), str(tmp_path)),
             nprocs=2, join=True)
    assert all((tmp_path / f"timings_{r}.pt").exists() for r in range(2))
    assert httpx.get(f"{qwen3_server.base_url}/weight_info").json()["weight_version"] == "11"
    assert_server_serves(qwen3_server, tiny_qwen3, perturbed(tiny_qwen3, seed=2))


@pytest.mark.vllm
def test_moe_round_trip(tiny_models, tmp_path):
    """Fused in-memory experts are unfused for vLLM, and the CPU MoE kernels use the new experts."""
    from conftest import start_server

    model_dir = tiny_models["qwen3_moe"]
    server = start_server(model_dir, tmp_path)
    try:
        assert_server_serves(server, model_dir, load_model(model_dir))
        trainer_model = perturbed(model_dir, seed=3)
        sync = WeightSync(server.base_url, CPU_FILE)
        sync.init(trainer_model)
        sync.sync(trainer_model, version=1)
        assert_server_serves(server, model_dir, trainer_model)
        sync.close()
    finally:
        server.stop()


@pytest.mark.vllm
def test_failed_update_raises_without_hanging(tiny_models, tmp_path):
    """A trainer model that does not match the served one (MoE names into a dense server) raises a clear error
    well within the timeout; the server is expected to be broken afterwards."""
    from conftest import start_server

    server = start_server(tiny_models["qwen3"], tmp_path)
    try:
        wrong_model = load_model(tiny_models["qwen3_moe"])
        sync = WeightSync(server.base_url, WeightSyncConfig(mode="cpu_file", timeout=60.0))
        sync.init(wrong_model)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="restart it"):
            sync.sync(wrong_model, version=1)
        assert time.monotonic() - start < 60.0
        sync.close()
    finally:
        server.stop()


# ---- GPU: the NCCL path end to end, against a stand-in for one vLLM worker ----------------------------------------
def _stand_in_vllm_worker(port: int, received_path: str) -> None:
    """The server side of the NCCL contract on cuda:1 without vLLM: the routes WeightSync calls, joining the
    group as rank 1 and cutting/unpacking chunks from the manifest as vLLM's consumer does."""
    from fake_vllm import FakeVLLM, get_routes, server_info_payload
    from grpo.nccl_broadcast import NcclGroup, packed_broadcast_receive

    state: dict = {}

    def init(request) -> dict:
        torch.cuda.set_device(1)  # the CUDA device is per thread
        info = state["info"] = request.body["init_info"]
        state["group"] = NcclGroup(info["master_address"], info["master_port"], rank=1,
                                   world_size=info["world_size"], timeout=120)
        return {}

    def update(request) -> dict:
        torch.cuda.set_device(1)
        received = {}
        packed_broadcast_receive(state["group"], request.body["update_info"], state["info"]["packed_buffer_size_bytes"],
                                 state["info"]["packed_num_buffers"],
                                 lambda chunk: received.update({n: t.clone() for n, t in chunk}))
        torch.cuda.synchronize()
        torch.save({n: t.cpu() for n, t in received.items()}, received_path)
        return {}

    torch.cuda.set_device(1)
    FakeVLLM(get_routes(server_info_payload()) | {
        "/weight_info": lambda request: {"weight_version": state.get("version")},
        "/init_weight_transfer_engine": init, "/update_weights": update,
        "/finish_weight_update": lambda request: state.update(version=request.body.get("weight_version")) or {},
    }, port=port).serve_forever()


@pytest.mark.gpu
def test_nccl_sync_end_to_end(tmp_path):
    """WeightSync(mode=nccl) on cuda:0 -> a stand-in worker on cuda:1: every checkpoint-named tensor arrives
    bit-exact in the server dtype (bf16), over many chunks (64 KiB buffers), MoE experts unfused."""
    import multiprocessing

    import transformers as tf

    from grpo.vllm_server import free_port as _free_port

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, vocab_size=1024)
    model = tf.Qwen3MoeForCausalLM(cfg).to("cuda:0")
    port, received_path = _free_port(), tmp_path / "received.pt"
    server = multiprocessing.get_context("spawn").Process(target=_stand_in_vllm_worker,
                                                          args=(port, str(received_path)), daemon=True)
    server.start()
    try:
        wait_until_up(f"http://127.0.0.1:{port}", server)
        sync = WeightSync(f"http://127.0.0.1:{port}",
                          WeightSyncConfig(mode="nccl", timeout=120, buffer_size_bytes=1 << 16))
        sync.init(model)
        timings = sync.sync(model, version=3)
        assert sync.control.weight_info() == "3" and timings["perf/weight_sync_transfer_s"] > 0
        received = torch.load(received_path)
        expected = {name: tensor.cpu() for name, tensor in sync.plan.iter_tensors()}
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in received
        assert list(received) == list(expected)
        for name, tensor in expected.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(received[name], tensor), name
        sync.close()
    finally:
        server.terminate()


def test_cpu_file_engine_implements_every_abstract_method():
    """vLLM instantiates the plugin's engine in every worker: a method the installed vLLM's base declares abstract
    and the plugin lacks kills the engine at start (vLLM 0.26 declares `trainer_send_weights` abstract; found
    on a real GPU server)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from grpo.vllm_plugin import CPUFileWeightTransferEngine

    assert not CPUFileWeightTransferEngine.__abstractmethods__
    assert hasattr(CPUFileWeightTransferEngine, "trainer_send_weights")
    with pytest.raises(NotImplementedError, match="weight_sync"):
        CPUFileWeightTransferEngine.trainer_send_weights(iter(()), {})
    assert issubclass(CPUFileWeightTransferEngine, WeightTransferEngine)


def test_a_slow_sync_phase_logs_where_the_threads_are(caplog):
    """A phase past SLOW_PHASE_S logs once where every thread is (the phase thread's own function among them, so
    a slow server answer is told from a busy trainer); a quick phase logs nothing."""
    import threading

    from grpo.sync_deadline import SLOW_PHASE_S, start_thread, wait_phase

    release = threading.Event()

    def waiting_for_the_server_answer():
        release.wait(5)
        return "answered"

    def quick():
        return "quick"

    caplog.set_level(logging.INFO, logger="grpo.weight_sync")
    assert wait_phase(*start_thread(quick, "vllm-pause"), "http://s", "pause", 3, 10, 60) == "quick"
    assert not [r for r in caplog.records if "so far" in r.getMessage()]
    timer = threading.Timer(SLOW_PHASE_S + 0.4, release.set)
    timer.start()
    assert wait_phase(*start_thread(waiting_for_the_server_answer, "vllm-pause"), "http://s", "pause", 3, 10,
                      60) == "answered"
    lines = [r.getMessage() for r in caplog.records if "so far" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "the pause phase on http://s" in lines[0] and "version 3" in lines[0]
    assert "vllm-pause: " in lines[0] and "waiting_for_the_server_answer" in lines[0]
    assert "MainThread: " in lines[0] and "wait_phase" in lines[0]
