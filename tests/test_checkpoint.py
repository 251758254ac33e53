"""Checkpoints: bit-exact resume in a fresh process group, resharded resume onto other meshes, a crash mid-save,
keep/latest, HF export, and bad input that is refused without touching anything."""

import functools
import hashlib
import os
import shutil

import pytest
import torch

import funcpar as fp
import harness
from fixtures import config
from funcpar.models import llama

STEPS = 6


def batches():
    out = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(500 + s)
        ids = torch.randint(0, 64, (8, 16), generator=g)
        labels = ids.clone()
        labels[s % 8, : 2 + s] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def make_step(mesh, zero=1, opt="adamw", layers=2):
    cfg = config(layers)
    o = fp.optim.adamw(1e-2, weight_decay=0.1) if opt == "adamw" else fp.optim.lion(1e-3)
    return fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), llama.specs(cfg, mesh), mesh=mesh,
                           optimizer=o, zero=zero, accum_steps=2, clip_norm=0.5), cfg


def run_steps(step, state, mesh, bs):
    losses = []
    dp, c = mesh.axis_size("dp"), mesh.coord("dp")
    for b in bs:
        state, m = step(state, {k: v.chunk(dp)[c] for k, v in b.items()})
        losses.append(m["loss"])
    return state, losses


def _train_and_save(sizes, folder):
    mesh = harness.mesh(**sizes)
    step, cfg = make_step(mesh)
    specs = llama.specs(cfg, mesh)
    full, full_losses = run_steps(step, step.init(fp.shard(llama.init(cfg), specs, mesh)), mesh, batches())
    state, losses = run_steps(step, step.init(fp.shard(llama.init(cfg), specs, mesh)), mesh, batches()[:3])
    step.save(os.path.join(folder, "step-3"), state, extra={"data_position": 3})
    return full_losses, losses, fp.gather(full.params, specs, mesh, dst=0)


def _resume(sizes, folder, zero):
    mesh = harness.mesh(**sizes) if sizes else fp.Mesh()
    step, cfg = make_step(mesh, zero)
    specs = llama.specs(cfg, mesh)
    step.init(fp.shard(llama.init(cfg, seed=123), specs, mesh))  # values are replaced by the checkpoint's
    stats = {}
    state, extra = step.load(folder, stats=stats)
    assert state.step == 3 and extra == {"data_position": 3}
    state, losses = run_steps(step, state, mesh, batches()[3:])
    return losses, fp.gather(state.params, specs, mesh, dst=0), stats["bytes_read"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ckpt"))
    res = harness.run(4, _train_and_save, {"tp": 2, "dp": 2}, folder)
    full_losses, first_losses, full_params = res[0]
    assert first_losses == full_losses[:3]
    return folder, full_losses, full_params


def test_resume_in_a_fresh_process_group_is_bit_exact(saved):
    folder, full_losses, full_params = saved
    pool = harness.Pool(4)  # new processes, a new gloo world
    try:
        res = pool.run(_resume_fresh, folder)
    finally:
        pool.close()
    losses, params, _ = res[0]
    assert losses == full_losses[3:]  # bit for bit
    for (name, a), (_, b) in zip(fp.tree.leaves_with_path(params), fp.tree.leaves_with_path(full_params), strict=True):
        assert torch.equal(a, b), name


def _resume_fresh(folder):
    return _resume({"tp": 2, "dp": 2}, folder, 1)


@pytest.mark.parametrize("sizes, zero", [({"tp": 4}, 1), ({"dp": 4}, 2), (None, 0)], ids=["tp4-zero1", "dp4-zero2", "single-zero0"])
def test_resume_on_another_mesh(saved, sizes, zero):
    folder, full_losses, full_params = saved
    if sizes is None:
        results = [_resume(None, folder, zero)]
    else:
        results = harness.run(4, _resume, sizes, folder, zero)
    losses, params, _ = results[0]
    for a, b in zip(losses, full_losses[3:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (sizes, losses, full_losses[3:])
    if sizes is not None:
        total = sum(os.path.getsize(os.path.join(folder, "step-3", f)) for f in os.listdir(os.path.join(folder, "step-3")) if f.endswith(".safetensors"))
        for _, _, nread in results:  # a rank reads the pieces overlapping what it now owns, not the checkpoint
            assert nread < 0.75 * total, (nread, total)


def test_export_to_hf_from_a_checkpoint(saved, tmp_path):
    tf = pytest.importorskip("transformers")

    folder, _, _ = saved
    cfg = config()
    fp.checkpoint.export_hf(folder, tmp_path / "hf", llama, cfg)
    params = fp.checkpoint.load_params(folder, llama.init(cfg, device="meta"), llama.specs(cfg))
    ids = batches()[0]["input_ids"]
    with torch.no_grad():
        ref = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(input_ids=ids).logits
    assert (llama.forward(params, ids, cfg, fp.Mesh()) - ref).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------------- crash mid-save


def _crash_mid_save(folder):
    import safetensors.torch as st

    mesh = fp.Mesh(tp=2, timeout=5)
    step, cfg = make_step(mesh)
    state, _ = run_steps(step, step.init(fp.shard(llama.init(cfg), llama.specs(cfg, mesh), mesh)), mesh, batches()[:1])
    step.save(os.path.join(folder, "step-1"), state)
    state, _ = run_steps(step, state, mesh, batches()[1:2])
    if mesh.rank == 1:
        real = st.save_file

        def write_then_die(*a, **k):
            real(*a, **k)
            os._exit(3)  # the machine goes away after this rank's file is on disk

        st.save_file = write_then_die
    try:
        step.save(os.path.join(folder, "step-2"), state)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_crash_mid_save_leaves_latest_at_the_previous_checkpoint(tmp_path):
    pool = harness.Pool(2)
    try:
        res = pool.run(_crash_mid_save, str(tmp_path), allow_death=True, timeout=120)
    finally:
        pool.close()
    assert isinstance(res[1], harness.Died)
    assert res[0].startswith("CollectiveError"), res[0]
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    assert not (tmp_path / "step-2").exists()
    cfg = config()
    params = fp.checkpoint.load_params(tmp_path, llama.init(cfg, device="meta"), llama.specs(cfg))  # loads
    assert params["embed"].shape == (64, 32)


# ---------------------------------------------------------------------------------------- single process


def test_keep_latest_and_rng(tmp_path):
    mesh = fp.Mesh()
    step, cfg = make_step(mesh)
    state = step.init(llama.init(cfg))
    for k, b in enumerate(batches()[:4], 1):
        state, _ = run_steps(step, state, mesh, [b])
        step.save(tmp_path / f"step-{k}", state, keep=2)
        after_save = torch.rand(3)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-3", "step-4"]
    assert (tmp_path / "latest").read_text().strip() == "step-4"
    loaded, _ = step.load(tmp_path)
    assert loaded.step == 4 and torch.equal(torch.rand(3), after_save)  # the RNG is where it was at save time
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fp.tree.leaves_with_path(loaded.params), fp.tree.leaves_with_path(state.params), strict=True))


def _digest(folder):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(folder)):
        for f in sorted(files):
            h.update(f.encode())
            h.update(open(os.path.join(root, f), "rb").read())
    return h.hexdigest()


def test_bad_checkpoints_are_refused_by_name(saved, tmp_path):
    folder, _, _ = saved
    mesh = fp.Mesh()
    before = _digest(folder)

    other, _ = make_step(mesh, layers=3)  # another model
    other.init(llama.init(config(3)))
    with pytest.raises(fp.checkpoint.CheckpointError, match=r"is from another model: it has no leaf 'layers.2.attn_norm'"):
        other.load(folder)

    lion, cfg = make_step(mesh, opt="lion")
    lion.init(llama.init(cfg))
    with pytest.raises(fp.checkpoint.CheckpointError, match=r"was saved with optimizer state ClipState, ScaleByAdamState, AddDecayedWeightsState, ScaleByLearningRateState; this step's is ClipState, ScaleByLionState, ScaleByLearningRateState \(first difference: '1.0.count' there, '1.0.mu.embed' here\)"):
        lion.load(folder)

    step, cfg = make_step(mesh)
    state0 = step.init(llama.init(cfg))
    snapshot = state0.params["embed"].clone()

    bad = tmp_path / "missing"
    shutil.copytree(os.path.join(folder, "step-3"), bad)
    os.remove(bad / "rank-00001.safetensors")
    with pytest.raises(fp.checkpoint.CheckpointError, match=r"checkpoint .*missing is missing rank-00001.safetensors"):
        step.load(bad)

    trunc = tmp_path / "trunc"
    shutil.copytree(os.path.join(folder, "step-3"), trunc)
    f = trunc / "rank-00002.safetensors"
    os.truncate(f, os.path.getsize(f) - 64)
    with pytest.raises(fp.checkpoint.CheckpointError, match=r"corrupt safetensors file .*trunc/rank-00002.safetensors: tensor '.*' ends at byte"):
        step.load(trunc)

    flipped = tmp_path / "flipped"
    shutil.copytree(os.path.join(folder, "step-3"), flipped)
    f = flipped / "rank-00001.safetensors"  # dp=0, tp=1: owns blocks of the parameters
    from funcpar.io.safetensors_header import read_header

    t = read_header(f)["param/layers.0.w_up"]  # a tensor this load reads
    data = bytearray(f.read_bytes())
    data[t.start + t.nbytes // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(fp.checkpoint.CheckpointError, match=r"corrupt checkpoint file .*flipped/rank-00001.safetensors: tensor 'param/layers.0.w_up' fails its CRC check"):
        step.load(flipped)

    with pytest.raises(fp.checkpoint.CheckpointError, match=r"is not a checkpoint \(no meta.json\) and has no 'latest' file"):
        step.load(tmp_path)
    assert _digest(folder) == before  # nothing was written to the checkpoint
    assert torch.equal(state0.params["embed"], snapshot)  # nor to the state in hand


def _masked_round_trip(folder):
    mesh = harness.mesh(dp=2)
    cfg = config()
    params = llama.init(cfg)
    frozen = fp.tree.map_with_path(lambda p, x: not p.startswith("layers.0."), params)
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), llama.specs(cfg, mesh), mesh=mesh,
                           optimizer=fp.optim.masked(fp.optim.sgd(0.1, momentum=0.9), frozen), zero=1)
    state, _ = run_steps(step, step.init(params), mesh, batches()[:2])
    step.save(os.path.join(folder, "m"), state)
    again, _ = step.load(os.path.join(folder, "m"))
    return [torch.equal(a, b) for (_, a), (_, b) in zip(fp.tree.leaves_with_path(again.opt_state), fp.tree.leaves_with_path(state.opt_state), strict=True)]


def test_masked_optimizer_state_round_trips_on_zero_parts(tmp_path):
    for same in harness.run(2, _masked_round_trip, str(tmp_path)):
        assert same and all(same)
