"""Issue 12, class by class: bad input gets a clear error and nothing trains silently."""

import math

import optree
import pytest
import torch

import funcpar as fp
import harness
from fixtures import SMALL, tiny_step


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_every_layer_of_a_config_built_in_python_changes_the_loss(name):
    cfg = SMALL[name]()  # every required field, nothing per layer: completed at construction
    model = fp.get_model(name)
    params = model.init(cfg, seed=0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    base = model.loss(params, {"input_ids": ids}, cfg, fp.Mesh()).item()
    for i in range(len(params["layers"])):
        scaled = {**params, "layers": [{k: v * 100 if j == i else v for k, v in lp.items()}
                                       for j, lp in enumerate(params["layers"])]}
        assert model.loss(scaled, {"input_ids": ids}, cfg, fp.Mesh()).item() != pytest.approx(base, rel=1e-3), i


@pytest.mark.parametrize("name, kw, message", [
    ("llama", {"vocab_size": 0}, "llama.Config: vocab_size=0, expected a positive int"),
    ("llama", {"num_hidden_layers": 2.0}, "llama.Config: num_hidden_layers=2.0, expected a positive int"),
    ("llama", {"num_attention_heads": 3}, "num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ("llama", {"sliding_windows": (None,)}, "sliding_windows=(None,) must give each of the 2 layers a window"),
    ("llama", {"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0 and rope_theta=10000.0 must be positive"),
    ("gpt2", {"n_head": 3}, "gpt2.Config: n_embd=32 is not a multiple of n_head=3"),
    ("gpt2", {"n_positions": -4}, "gpt2.Config: n_positions=-4, expected a positive int"),
    ("gpt2", {"layer_norm_epsilon": 0.0}, "gpt2.Config: layer_norm_epsilon=0.0 must be positive"),
])
def test_a_config_no_model_has_is_refused_at_construction(name, kw, message):
    with pytest.raises(ValueError) as e:
        SMALL[name](**kw)
    assert message in str(e.value)


# ------------------------------------------------------------------------------ class 1: non-finite training


@pytest.mark.parametrize("make, message", [
    (lambda: fp.optim.adamw(float("nan")), "scale_by_learning_rate: lr=nan is not a finite number in [0, inf)"),
    (lambda: fp.optim.adamw(-1e-3), "scale_by_learning_rate: lr=-0.001 is not a finite number in [0, inf)"),
    (lambda: fp.optim.adamw(1e-3, b1=2.0), "scale_by_adam: b1=2.0 is not a finite number in [0, 1)"),
    (lambda: fp.optim.adamw(fp.optim.warmup_cosine(float("inf"), 10, 100)),
     "warmup_cosine: peak=inf is not a finite number in [0, inf)"),
    (lambda: fp.optim.clip_by_global_norm(-1.0), "clip_by_global_norm: max_norm=-1.0 is not a finite number in (0, inf)"),
    (lambda: fp.optim.sgd(0.1, momentum=-0.5), "trace: decay (momentum)=-0.5 is not a finite number in [0, 1]"),
    (lambda: fp.optim.lion(1e-4, weight_decay=-0.1),
     "add_decayed_weights: weight_decay=-0.1 is not a finite number in [0, inf)"),
])
def test_optimizer_hyper_parameters_are_checked_at_construction(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value) == message


def _ids(seed=0):
    return {"input_ids": torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(seed))}


def _poison(step, state, leaf="layers.1.w_down"):
    """NaN into one weight, in the step's own buffers (what a bad update or a corrupt load would leave). An MLP
    weight: its NaN reaches the loss through matmuls and sums on every CPU. (In a query weight it did not on an
    AVX-512 Xeon: torch's CPU attention kernel's vectorized max dropped the NaN scores, the loss came out finite and
    only the gradient norm was NaN; the step stopped all the same, with that reason.)"""
    dict(fp.tree.leaves_with_path(state.params))[leaf].view(-1)[0] = float("nan")


def test_a_non_finite_loss_stops_training_with_nothing_updated():
    step, state = tiny_step(fp.Mesh())
    state, m = step(state, _ids(0))
    before = {p: x.clone() for p, x in fp.tree.leaves_with_path(state.params)}
    _poison(step, state)
    with pytest.raises(fp.StepError) as e:
        step(state, _ids(1))
    assert str(e.value).startswith("step 2: the loss is nan; nothing was updated and training stops "
                                   "(nonfinite='error'): lower the learning rate")
    kept = e.value.state  # the state before the step, live: it can be saved or inspected
    assert kept.step == 1
    for p, x in fp.tree.leaves_with_path(kept.params):
        assert torch.equal(x, before[p]) or p == "layers.1.w_down", p


def test_skip_policy_and_loss_scaling_stop_after_max_skips():
    step, state = tiny_step(fp.Mesh(), nonfinite="skip", max_skips=2)
    _poison(step, state)
    for k in range(2):
        state, m = step(state, _ids(k))
        assert m["skipped"] and state.step == 0
    with pytest.raises(fp.StepError, match=r"step 1: the loss is nan; nothing was updated and training stops \(3 "
                                           r"steps in a row skipped \(max_skips=2\)\)"):
        step(state, _ids(2))
    step, state = tiny_step(fp.Mesh(), param_dtype=torch.float16, max_skips=3)
    _poison(step, state)
    for k in range(3):
        state, m = step(state, _ids(k))
        assert m["skipped"]
    with pytest.raises(fp.StepError, match=r"step 1: the loss is nan; nothing was updated and training stops \(4 "
                                           r"steps in a row skipped \(max_skips=3, loss scale now 8192\)\)"):
        step(state, _ids(3))


def _one_rank_goes_bad():
    mesh = harness.mesh(dp=2)
    step, state = tiny_step(mesh)
    state, _ = step(state, _ids(mesh.rank))  # the first step checks that replicas agree; after it, one goes bad
    if mesh.rank == 1:  # one replica's weights only: every rank hears of it through the statistics' all-reduce
        _poison(step, state)
    try:
        step(state, _ids(2 + mesh.rank))
    except fp.StepError as e:
        return str(e)


def test_every_rank_stops_at_the_same_step_when_one_goes_non_finite():
    msgs = harness.run(2, _one_rank_goes_bad)
    assert msgs[0] == msgs[1] and msgs[0].startswith("step 2: the loss is nan; nothing was updated")


def test_a_schedule_that_goes_non_finite_stops_before_updating():
    step, state = tiny_step(fp.Mesh(), optimizer=fp.optim.adamw(lambda k: 1e-3 if k == 0 else float("nan")))
    state, _ = step(state, _ids(0))
    before = [x.clone() for x in optree.tree_leaves((state.params, state.opt_state))]
    with pytest.raises(fp.StepError, match=r"step 2: the learning rate schedule gives nan, not a finite number >= 0; "
                                           r"nothing was updated") as e:
        step(state, _ids(1))
    after = optree.tree_leaves((e.value.state.params, e.value.state.opt_state))
    assert len(after) == len(before) and all(torch.equal(x, y) for x, y in zip(after, before, strict=True))  # moments too


@pytest.mark.subprocess
def test_the_command_line_refuses_a_non_finite_learning_rate_before_writing_anything(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-m", "funcpar", "train", "--model", "llama-micro", "--mesh", "1", "--lr", "nan",
                        "--steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0 and "funcpar: --lr nan: must be a number at least 0" in p.stderr
    assert not out.exists()


# ------------------------------------------------------------------------ class 3: out-of-range ids and labels


def _bad_token(entry, value, tp):
    mesh = harness.mesh(tp=tp, dp=2) if tp > 1 else harness.mesh(dp=2)
    step, state = tiny_step(mesh)
    before = [x.clone() for x in optree.tree_leaves(state.params)]
    batch = _ids(mesh.coord("dp"))
    batch["labels"] = batch["input_ids"].clone()
    if mesh.coord("dp") == 1:
        batch[entry][1, 3] = value
    with pytest.raises(fp.StepError) as e:
        step(state, batch)
    same = all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(state.params), before, strict=True))
    return str(e.value), same


@pytest.mark.parametrize("entry, value, tp", [("input_ids", 64, 2), ("input_ids", -1, 1), ("labels", 70, 2)])
def test_out_of_range_ids_and_labels_stop_every_rank_with_the_value_named(entry, value, tp):
    out = harness.run(2 * tp, _bad_token, entry, value, tp)
    for rank, (msg, unchanged) in enumerate(out):
        assert unchanged
        dp = rank // tp
        if dp == 1:
            assert msg == (f"batch['{entry}'] holds {value} at [1, 3] (1 such entries), outside the vocabulary [0, 64)"
                           + (" (and not -100)" if entry == "labels" else ""))
        else:
            assert msg == "1 problem(s) in another data-parallel rank's batch (its error names them)"


def test_tp_ranks_fed_different_batches_are_caught_on_the_first_step_by_default():
    msgs = harness.run(2, _tp_mismatch)
    assert all("Data inconsistency within the TP group: batch['input_ids'] differs across mesh axis 'tp'" in m
               for m in msgs)


def _tp_mismatch():
    mesh = harness.mesh(tp=2)
    step, state = tiny_step(mesh)  # check is not passed: it is on for the first step by default
    with pytest.raises(fp.StepError) as e:
        step(state, _ids(mesh.coord("tp")))
    return str(e.value)


def _tp_drift(check_every, start):
    """tp ranks fed the same batches until step ``start``, then different ones: the step that stops (or None)."""
    mesh = harness.mesh(tp=2)
    step, state = tiny_step(mesh, check_every=check_every)
    for k in range(6):
        try:
            state, _ = step(state, _ids(k if k < start else 10 * k + mesh.coord("tp")))
        except fp.StepError as e:
            return k, str(e)
    return None, ""


def test_tp_ranks_that_drift_apart_later_are_caught_at_that_step():
    """The batch check runs every step by default (the batch's checksums folded into the all-reduce of the step's
    statistics, no collective of its own):
    ranks whose data diverges at the third step stop there; `check_every=2` catches a divergence at the fourth step
    on the fifth (the next even one), and `check_every=0` (the first step only) lets it train."""
    every = harness.run(2, _tp_drift, 1, 2)
    assert [k for k, _ in every] == [2, 2]
    assert all("Data inconsistency within the TP group: batch['input_ids'] differs across mesh axis 'tp'" in m
               for _, m in every)
    assert [k for k, _ in harness.run(2, _tp_drift, 2, 3)] == [4, 4]
    assert [k for k, _ in harness.run(2, _tp_drift, 0, 2)] == [None, None]
    # tp=2 x dp=2, only dp group 0's tp ranks drift apart: all four ranks stop at that step, with the same line
    both = harness.run(4, _one_group_drifts)
    assert [k for k, _ in both] == [2] * 4 and len({m for _, m in both}) == 1
    assert "differs across mesh axis 'tp' (group ranks [0, 1])" in both[0][1]


def _one_group_drifts():
    mesh = harness.mesh(dp=2, tp=2)
    step, state = tiny_step(mesh)
    for k in range(4):
        drift = k >= 2 and mesh.coord("dp") == 0
        try:
            state, _ = step(state, _ids(10 * k + (mesh.coord("tp") if drift else 0) + 100 * mesh.coord("dp")))
        except fp.StepError as e:
            return k, str(e)
    return None, ""


# --------------------------------------------------------------------------- class 6: errors a user can act on


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "0"], "funcpar: --seq-len 0: must be a number at least 1"),
    (["--global-batch", "0"], "funcpar: --global-batch 0: must be a number at least 1"),
    (["--steps", "-1"], "funcpar: --steps -1: must be a number at least 0"),
    (["--zero", "4"], "funcpar: --zero 4: must be a number at least 0 and at most 3"),
])
def test_command_line_numbers_out_of_range_are_named(argv, message):
    from funcpar.cli import options

    with pytest.raises(SystemExit) as e:
        options.read_options(argv, "train")
    assert str(e.value) == message


def test_config_file_values_of_the_wrong_type_and_repeated_mesh_axes_are_named(tmp_path):
    from funcpar.cli import options

    f = tmp_path / "run.json"
    f.write_text('{"seq_len": "1024"}')
    with pytest.raises(SystemExit) as e:
        options.read_options(["--config", str(f)], "train")
    assert str(e.value) == f"funcpar: --seq-len '1024' (from {f} or the command line): expected int"
    with pytest.raises(SystemExit) as e:
        options.parse_mesh("tp=2,tp=1")
    assert str(e.value) == "funcpar: bad --mesh 'tp=2,tp=1': axis 'tp' is given twice"


@pytest.mark.parametrize("suffix, content, where", [
    (".jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', ":2: not UTF-8 text (byte 0xe9 at column 14)"),
    (".txt", b"first doc\n\nsecond \xff doc\n", ":3: not UTF-8 text (byte 0xff at column 8)"),
    (".jsonl", b"\xfe\xff{}\n", ":1: not UTF-8 text (byte 0xfe at column 1)"),
])
def test_data_that_is_not_utf8_is_named_by_file_and_line(tmp_path, suffix, content, where):
    f = tmp_path / f"data{suffix}"
    f.write_bytes(content)
    with pytest.raises(fp.data.DataError) as e:
        fp.data.load_samples(f)
    assert str(e.value) == f"{f}{where}; save the file as UTF-8"


# --------------------------------------------------------------- the global gradient norm over large buckets


def _big_bucket_norm():
    mesh = harness.mesh(dp=2)
    cfg = SMALL["llama"](vocab_size=8192, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=64)
    model = fp.get_model("llama")
    specs = model.specs(cfg, mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, clip_norm=1.0)
    state = step.init(fp.shard(model.init(cfg, seed=0), specs, mesh))
    ids = torch.randint(0, 8192, (4, 16), generator=torch.Generator().manual_seed(0))
    return step(state, {"input_ids": ids.chunk(2)[mesh.coord("dp")]})[1]["grad_norm"]


def test_the_global_gradient_norm_is_exact_over_large_buckets():
    cfg = SMALL["llama"](vocab_size=8192, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=64)
    model = fp.get_model("llama")
    params = model.init(cfg, seed=0)
    ids = torch.randint(0, 8192, (4, 16), generator=torch.Generator().manual_seed(0))
    grads = torch.func.grad(lambda p: model.loss(p, {"input_ids": ids}, cfg, fp.Mesh()))(params)
    want = math.sqrt(sum((g.double() ** 2).sum().item() for g in optree.tree_leaves(grads)))
    for got in harness.run(2, _big_bucket_norm):  # each rank's part of the 4.2M-element bucket is 2.1M elements
        assert abs(got - want) <= 2e-6 * want, (got, want)


# ----------------------------------------------------------------- class 4: paths read from files stay inside


def _snapshot(root):
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_checkpoint_metadata_cannot_name_files_outside_the_checkpoint(tmp_path, name):
    import json

    step, state = tiny_step(fp.Mesh())
    step.save(tmp_path / "run" / "step-0", state)
    (tmp_path / "outside.safetensors").write_bytes(b"not for you")
    meta_file = tmp_path / "run" / "step-0" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["pieces"][0]["file"] = name
    meta_file.write_text(json.dumps(meta))
    before = _snapshot(tmp_path)
    with pytest.raises(fp.checkpoint.CheckpointError) as e:
        step.load(tmp_path / "run")
    assert f"names {name!r}, which is not a file name inside {tmp_path / 'run' / 'step-0'}: refusing" in str(e.value)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("target", ["../other-run/step-3", "/tmp", ".."])
def test_latest_cannot_point_outside_its_folder(tmp_path, target):
    step, state = tiny_step(fp.Mesh())
    step.save(tmp_path / "run" / "step-0", state)
    (tmp_path / "run" / "latest").write_text(target + "\n")
    before = _snapshot(tmp_path)
    with pytest.raises(fp.checkpoint.CheckpointError, match=f"{tmp_path / 'run' / 'latest'} names {target!r}, which "
                                                           "is not a file name inside"):
        step.load(tmp_path / "run")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["../evil.safetensors", "/abs/model.safetensors", 7])
def test_an_hf_index_cannot_name_files_outside_the_model_folder(tmp_path, name):
    import json

    import hf_fixtures

    folder = tmp_path / "model"
    hf_fixtures.make_checkpoint("llama", str(folder), max_shard_size="100KB")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = name
    index.write_text(json.dumps(data))
    before = _snapshot(tmp_path)
    with pytest.raises(fp.hf.HFError) as e:
        fp.hf.load(folder)
    assert f"index {index} names {name!r}, which is not a file name inside {folder}: refusing to open it" == str(e.value)
    assert _snapshot(tmp_path) == before


# ------------------------------------------------------------- class 2: keep prunes only its own run's checkpoints


def test_keep_prunes_only_its_own_runs_checkpoints_and_a_resumed_run_is_the_same_run(tmp_path):
    ckpts = tmp_path / "ckpts"
    other, other_state = tiny_step(fp.Mesh())
    other.save(ckpts / "other-1", other_state)  # another run's checkpoint beside ours
    other_files = _snapshot(ckpts / "other-1")
    step, state = tiny_step(fp.Mesh())
    for k in range(3):
        state, _ = step(state, _ids(k))
        step.save(ckpts / f"step-{k + 1}", state, keep=2)
    names = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    assert names == ["other-1", "step-2", "step-3"]  # ours pruned to 2; the other run's untouched
    assert _snapshot(ckpts / "other-1") == other_files
    resumed, _ = tiny_step(fp.Mesh())
    state, _ = resumed.load(ckpts)  # latest: step-3
    state, _ = resumed(state, _ids(3))
    resumed.save(ckpts / "step-4", state, keep=1)  # the resumed run is the same run: its older checkpoints go
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["other-1", "step-4"]
    other.save(ckpts / "other-2", other_state, keep=1)  # and the other run prunes only its own
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["other-2", "step-4"]


# --------------------------------------------- class 2: funcpar replaces only folders it wrote, and crash-safely


def _hf_save(folder, **kw):
    cfg, model = SMALL["llama"](), fp.get_model("llama")
    fp.hf.save(folder, model.init(cfg, seed=0), model, cfg, **kw)


_RUN: list = []  # one step, so one run: a run replaces its own checkpoint folders, not another run's


def _ckpt_save(folder, **kw):
    _RUN[:] = _RUN or [tiny_step(fp.Mesh())]
    step, state = _RUN[0]
    step.save(folder, state, **kw)


def _user_files(folder):
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "sub").mkdir()
    (folder / "sub" / "data.bin").write_bytes(b"\x00\x01")


@pytest.mark.parametrize("save, error", [(_hf_save, fp.hf.HFError), (_ckpt_save, fp.checkpoint.CheckpointError)])
@pytest.mark.parametrize("prepare, why", [
    (_user_files, "exists and was not written by funcpar (it has no .funcpar marker): refusing to replace what is in "
                  "it; choose another folder, empty it, or pass overwrite=True (--overwrite on the command line)"),
    (lambda f: f.write_text("a file"), "exists and is not a folder: refusing to replace it; choose another path "
                                       "(or pass overwrite=True / --overwrite)"),
])
def test_saving_refuses_a_folder_funcpar_did_not_write_and_changes_nothing(tmp_path, save, error, prepare, why):
    target = tmp_path / "out"
    prepare(target)
    before = _snapshot(tmp_path)
    with pytest.raises(error) as e:
        save(target)
    assert str(e.value) == f"{target} {why}"
    assert _snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("save", [_hf_save, _ckpt_save])
def test_funcpar_replaces_its_own_folders_an_empty_one_or_any_with_overwrite(tmp_path, save):
    (tmp_path / "empty").mkdir()
    save(tmp_path / "empty")
    assert (tmp_path / "empty" / ".funcpar").is_file()
    first = _snapshot(tmp_path / "empty")
    save(tmp_path / "empty")  # its own: replaced without asking
    assert _snapshot(tmp_path / "empty").keys() == first.keys()
    _user_files(tmp_path / "mine")
    save(tmp_path / "mine", overwrite=True)
    assert not (tmp_path / "mine" / "notes.txt").exists() and (tmp_path / "mine" / ".funcpar").is_file()


@pytest.mark.subprocess
def test_convert_refuses_a_destination_funcpar_did_not_write(tmp_path):
    import subprocess
    import sys

    import hf_fixtures

    hf_fixtures.make_checkpoint("llama", str(tmp_path / "model"))
    _user_files(tmp_path / "dst")
    before = _snapshot(tmp_path)
    p = subprocess.run([sys.executable, "-m", "funcpar", "convert", str(tmp_path / "model"), str(tmp_path / "dst")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and f"{tmp_path / 'dst'} exists and was not written by funcpar" in p.stderr
    assert _snapshot(tmp_path) == before


def _snap_params(state):
    return {p: x.clone() for p, x in fp.tree.leaves_with_path(state.params)}


@pytest.mark.parametrize("exchange", [True, False])
def test_a_crash_while_replacing_a_checkpoint_leaves_one_whole_checkpoint(tmp_path, monkeypatch, exchange):
    """Re-saving under an existing name: a process killed mid-swap leaves a complete checkpoint that loads: the new
    one after the atomic exchange, the old one (put back from .NAME.old) between the fallback's two renames."""
    from funcpar.io import atomic

    step, state = tiny_step(fp.Mesh())
    old = _snap_params(state)
    step.save(tmp_path / "step-1", state)
    state, _ = step(state, _ids(0))
    new = _snap_params(state)
    step.save(tmp_path / "staging" / "step-1", state)
    atomic.os.rename(tmp_path / "staging" / "step-1", tmp_path / ".step-1.tmp")  # a finished replacement
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    renames, real_rename = [], atomic.os.rename

    def killed_on_second_rename(a, b):
        renames.append((a, b))
        if len(renames) == 2:
            raise KeyboardInterrupt("killed")
        real_rename(a, b)

    monkeypatch.setattr(atomic.os, "rename", killed_on_second_rename)
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    with pytest.raises(KeyboardInterrupt):
        atomic.swap_into_place(tmp_path / ".step-1.tmp", tmp_path / "step-1")
    monkeypatch.undo()
    assert (tmp_path / "step-1").exists() == exchange  # the fallback died with step-1 renamed away
    loaded, _ = step.load(tmp_path)  # latest -> step-1: recovered from .step-1.old where needed
    want = new if exchange else old
    assert all(torch.equal(x, want[p]) for p, x in fp.tree.leaves_with_path(loaded.params))
    step.save(tmp_path / "step-1", fp.TrainState(loaded.params, loaded.opt_state, 5))  # and saving goes on
    assert step.load(tmp_path)[0].step == 5


def test_keep_does_not_take_a_folder_whose_metadata_was_edited_to_claim_the_run(tmp_path):
    import json

    ckpts = tmp_path / "ckpts"
    step, state = tiny_step(fp.Mesh())
    step.save(ckpts / "step-1", state)
    other, other_state = tiny_step(fp.Mesh())
    other.save(ckpts / "theirs", other_state)
    meta_file = ckpts / "theirs" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["run"] = step.run_id  # edited by hand to look like ours (its checksum no longer matches)
    meta_file.write_text(json.dumps(meta))
    before = _snapshot(ckpts / "theirs")
    state, _ = step(state, _ids(0))
    step.save(ckpts / "step-2", state, keep=1)
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step-2", "theirs"]
    assert _snapshot(ckpts / "theirs") == before


@pytest.mark.subprocess
@pytest.mark.parametrize("config, message", [
    ("[1, 2]", "config.json holds an array, not an object of config keys: is it a model's config.json?"),
    ("{", "config.json is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ('{"model_type": "llama", "vocab_size": "64"}', "config.json: config key 'vocab_size' is '64' (a string), "
                                                    "expected an integer"),
])
def test_the_command_line_names_a_bad_config_json_of_a_model_folder(tmp_path, config, message):
    import subprocess
    import sys

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(config)
    before = _snapshot(tmp_path)
    p = subprocess.run([sys.executable, "-m", "funcpar", "train", "--model", "model", "--mesh", "1", "--steps", "1"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and p.stderr == f"funcpar: model/{message}\n"
    assert _snapshot(tmp_path) == before


@pytest.mark.subprocess
def test_convert_reads_only_verified_checkpoint_metadata(tmp_path):
    import json
    import subprocess
    import sys

    step, state = tiny_step(fp.Mesh())
    step.save(tmp_path / "ckpt", state, extra={"model": "llama", "config": SMALL["llama"]().to_hf()})
    meta_file = tmp_path / "ckpt" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["extra"]["config"]["num_hidden_layers"] = 1  # edited by hand
    meta_file.write_text(json.dumps(meta))
    before = _snapshot(tmp_path)
    p = subprocess.run([sys.executable, "-m", "funcpar", "convert", "ckpt", "hf"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1 and p.stderr.startswith("funcpar: ckpt/meta.json has been modified since it was written")
    assert _snapshot(tmp_path) == before


def _disk_fills(tmp: str, rank_full: int):
    """Rank ``rank_full``'s checkpoint file meets a full disk (safetensors reports it in its own exception type)."""
    import safetensors.torch

    mesh = harness.mesh(dp=2)
    step, state = tiny_step(mesh)
    step.save(f"{tmp}/ck/step-0", state, keep=3)
    real = safetensors.torch.save_file

    def full(*a, **k):
        if mesh.rank == rank_full:
            raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                               'left on device" })')
        return real(*a, **k)

    safetensors.torch.save_file = full
    try:
        step.save(f"{tmp}/ck/step-1", state, keep=3)
    except fp.checkpoint.CheckpointError as e:
        return str(e)
    finally:
        safetensors.torch.save_file = real
    return "saved"


def test_a_full_disk_during_a_save_is_one_line_on_every_rank_and_loses_nothing(tmp_path):
    """The rank whose write fails and the one whose write succeeded say the same line: where, how much is free,
    and that the checkpoints before it are intact (the previous one still loads)."""
    msgs = harness.run(2, _disk_fills, str(tmp_path), 1)
    assert msgs[0] == msgs[1] and "\n" not in msgs[0]
    assert msgs[0].startswith(f"no space left on the device (or the disk quota is used up) writing {tmp_path}/ck/"
                              f"step-1 (") and msgs[0].endswith(
        " GiB free there): nothing was written and what was there is unchanged; the checkpoints before it are intact: "
        "free space, then --resume continues from the latest")
    assert not (tmp_path / "ck" / "step-1").exists() and not list((tmp_path / "ck").glob(".step-1*"))
    step, state = tiny_step(fp.Mesh())
    step.load(tmp_path / "ck" / "step-0", state)
