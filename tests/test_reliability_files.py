"""Issue 12, classes 4 and 6 for files: nothing read from disk is trusted (checkpoint metadata against its schema and
its checksum, safetensors layouts as the format allows them) and a file that cannot be used is named with what is
wrong in it (a tensor in another dtype, a config.json key of the wrong type). Each refusal leaves every file as it
was."""

import hashlib
import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import funcpar as fp
import hf_fixtures
from fixtures import SMALL, tiny_step
from funcpar.io.checkpoint_source import crc


def _snapshot(root):
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A step and a checkpoint of it (copied by each test into its own folder)."""
    step, state = tiny_step(fp.Mesh())
    folder = tmp_path_factory.mktemp("ckpt") / "run"
    step.save(folder / "step-0", state)
    return step, folder


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for kind in ("llama", "gpt2"):
        hf_fixtures.make_checkpoint(kind, str(root / kind))
    return root


def _checkpoint(saved, tmp_path):
    step, src = saved
    shutil.copytree(src, tmp_path / "run")
    return step, tmp_path / "run" / "step-0"


def _edit_meta(folder, edit, reseal=False):
    """Edit meta.json as a person would (``reseal``: and its checksum too, as a writer that gets it wrong would)."""
    meta = json.loads((folder / "meta.json").read_text())
    meta = edit(meta) or meta
    data = json.dumps(meta).encode()
    (folder / "meta.json").write_bytes(data)
    if reseal:
        (folder / "meta.json.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  meta.json\n")


def _set(path, value):
    def edit(meta):
        obj = meta
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return edit


# -------------------------------------------------------------------------- class 4 (a): the metadata's schema


@pytest.mark.parametrize("edit, message", [
    (_set(["step"], "5"), "step is '5', expected an int >= 0"),
    (_set(["params", 0, "shape"], [10**12, 10**6]),
     "the pieces of 'param/embed' hold 2048 elements, but its shape [1000000000000, 1000000] has "
     "1000000000000000000"),
    (_set(["pieces", 0, "block"], [[0, 10**12], [0, 10**6]]),
     "pieces[0].block [[0, 1000000000000], [0, 1000000]] does not lie inside the shape [64, 32] of 'param/embed'"),
    (_set(["pieces", 0, "flat"], [0, 10**12]),
     "pieces[0].flat [0, 1000000000000] does not fit inside its block [[0, 64], [0, 32]] (2048 elements) of "
     "'param/embed'"),
    (_set(["params", 0, "dtype"], "float128"),
     "params[0].dtype is 'float128', expected one of float64, float32, float16, bfloat16, int64, int32, int16, "
     "int8, uint8, bool, float8_e4m3fn, float8_e5m2"),
    (lambda m: m["pieces"][0].pop("key") and None, "pieces[0].key is missing (expected a string)"),
    (_set(["opt", 1, "param"], "no.such.leaf"),
     "opt[1].param is 'no.such.leaf', expected null or the path of a leaf in params"),
    (_set(["pieces", 3, "tensor"], "param/elsewhere"),
     "pieces[3].tensor is 'param/elsewhere', expected the name of a leaf in params or opt ('param/PATH', "
     "'opt/PATH') or a rank's 'rng/torch/RANK'"),
])
def test_checkpoint_metadata_is_checked_against_its_schema_before_anything_is_allocated(saved, tmp_path, edit,
                                                                                        message):
    step, folder = _checkpoint(saved, tmp_path)
    _edit_meta(folder, edit)
    before = _snapshot(tmp_path)
    with pytest.raises(fp.checkpoint.CheckpointError) as e:
        step.load(folder.parent)
    assert str(e.value) == f"{folder / 'meta.json'}: {message}"
    assert _snapshot(tmp_path) == before


def _split_first_piece(meta):
    """Two pieces in place of the first one, each claiming half of its file's tensor."""
    pc = meta["pieces"][0]
    half = {**pc, "flat": [1024, 2048]}
    pc["flat"] = [0, 1024]
    meta["pieces"].insert(1, half)


@pytest.mark.parametrize("edit, message", [
    (_split_first_piece, "tensor 'param/embed' holds 8192 bytes, but meta.json says its piece of 'param/embed' is "
                         "elements 0..1024 of float32 (4096 bytes)"),
    (lambda m: [pc.update(key="param/norm") for pc in m["pieces"] if pc["key"] == "param/lm_head"] and None,
     "tensor 'param/norm' holds 128 bytes, but meta.json says its piece of 'param/lm_head' is elements 0..2048 of "
     "float32 (8192 bytes)"),
    (lambda m: [pc.update(key="param/nothing") for pc in m["pieces"] if pc["key"] == "param/norm"] and None,
     "has no tensor 'param/nothing'"),
])
def test_a_piece_must_match_its_file_header_before_it_is_read(saved, tmp_path, edit, message):
    step, folder = _checkpoint(saved, tmp_path)
    _edit_meta(folder, edit, reseal=True)  # consistent to its checksum: the header is what catches it
    before = _snapshot(tmp_path)
    with pytest.raises(fp.checkpoint.CheckpointError) as e:
        step.load(folder.parent)
    sep = " " if message.startswith("has no") else ": "
    assert str(e.value) == f"{folder / 'rank-00000.safetensors'}{sep}{message}"
    assert _snapshot(tmp_path) == before


# ------------------------------------------------------------------------- class 4 (b): the metadata's checksum


def _hand_edit(old, new):
    def edit(folder):
        text = (folder / "meta.json").read_text()
        assert old in text
        (folder / "meta.json").write_text(text.replace(old, new, 1))
    return edit


@pytest.mark.parametrize("edit, message", [
    (_hand_edit('"step": 0', '"step": 7'), "{meta} has been modified since it was written (checksum mismatch with "
     "meta.json.sha256): funcpar loads no metadata it cannot vouch for; restore the checkpoint from a copy or "
     "load another one"),
    (_hand_edit('"dtype": "float32"', '"dtype": "float16"'), "{meta} has been modified since it was written "
     "(checksum mismatch with meta.json.sha256): funcpar loads no metadata it cannot vouch for; restore the "
     "checkpoint from a copy or load another one"),
    (_hand_edit('"complete": true,', '"complete": true, '), "{meta} has been modified since it was written "
     "(checksum mismatch with meta.json.sha256): funcpar loads no metadata it cannot vouch for; restore the "
     "checkpoint from a copy or load another one"),
    (lambda folder: (folder / "meta.json.sha256").unlink(), "{folder} has no meta.json.sha256 beside its meta.json: "
     "its metadata cannot be verified (not a complete checkpoint of this funcpar version)"),
    (lambda folder: (folder / "meta.json.sha256").write_text("0" * 63 + "  meta.json\n"),
     "{folder}/meta.json.sha256 is not the line '<SHA-256 in hex>  meta.json' funcpar writes"),
])
def test_meta_json_edited_by_hand_is_detected(saved, tmp_path, edit, message):
    step, folder = _checkpoint(saved, tmp_path)
    edit(folder)
    before = _snapshot(tmp_path)
    with pytest.raises(fp.checkpoint.CheckpointError) as e:
        step.load(folder.parent)
    assert str(e.value) == message.format(meta=folder / "meta.json", folder=folder)
    assert _snapshot(tmp_path) == before


def test_a_saved_checkpoint_carries_the_checksum_sha256sum_reads(saved):
    _, folder = saved
    line = (folder / "step-0" / "meta.json.sha256").read_text()
    assert line == f"{hashlib.sha256((folder / 'step-0' / 'meta.json').read_bytes()).hexdigest()}  meta.json\n"


# ------------------------------------------------------------ class 4 (c): safetensors layouts the format forbids


def _st(tensors, trailing=0):
    """A safetensors file by hand: ``{name: (start, stop)}`` of U8 tensors, and ``trailing`` bytes after them."""
    header = json.dumps({n: {"dtype": "U8", "shape": [b - a], "data_offsets": [a, b]}
                         for n, (a, b) in tensors.items()}).encode()
    end = max((b for _, b in tensors.values()), default=0)
    return struct.pack("<Q", len(header)) + header + bytes(end + trailing)


@pytest.mark.parametrize("tensors, trailing, message", [
    ({"a": (0, 8), "b": (4, 12)}, 0, "tensors 'a' (data bytes 0..8) and 'b' (data bytes 4..12) overlap"),
    ({"a": (0, 8), "b": (0, 8)}, 0, "tensors 'a' (data bytes 0..8) and 'b' (data bytes 0..8) overlap"),
    ({"a": (0, 8), "b": (12, 20)}, 0,
     "data bytes 8..12 between tensors 'a' (data bytes 0..8) and 'b' (data bytes 12..20) belong to no tensor"),
    ({"b": (4, 12)}, 0, "data bytes 0..4 before tensor 'b' belong to no tensor"),
    ({"a": (0, 8), "b": (8, 12)}, 3, "its last 3 bytes, after tensor 'b' (data bytes 8..12), belong to no tensor"),
])
def test_safetensors_with_overlapping_tensors_or_holes_is_refused(hf_folders, tmp_path, tensors, trailing, message):
    folder = tmp_path / "model"
    shutil.copytree(hf_folders / "llama", folder)
    f = folder / "model.safetensors"
    f.write_bytes(_st(tensors, trailing))
    with pytest.raises(Exception):  # the safetensors library refuses the same file
        with safe_open(str(f), "pt") as st:
            [st.get_tensor(k) for k in st.keys()]
    before = _snapshot(tmp_path)
    with pytest.raises(fp.hf.HFError) as e:
        fp.hf.load(folder)
    assert str(e.value) == f"corrupt safetensors file {f}: {message}"
    assert _snapshot(tmp_path) == before


def test_a_layout_the_format_allows_is_read(tmp_path):
    f = tmp_path / "ok.safetensors"  # out of order in the header, empty tensors at the start and the end
    f.write_bytes(_st({"b": (8, 12), "a": (0, 8), "e": (0, 0), "z": (12, 12)}))
    from funcpar.io.safetensors_header import read_header

    assert sorted(read_header(f)) == ["a", "b", "e", "z"]


# --------------------------------------------------------------------- class 6 (d): a tensor in another dtype


def _retype(file, name, dtype):
    tensors = load_file(str(file))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return tensors[name]


def _hf_retyped(hf_folders, tmp_path, name, dtype, config_edit=None):
    folder = tmp_path / "model"
    shutil.copytree(hf_folders / "llama", folder)
    _retype(folder / "model.safetensors", name, dtype)
    if config_edit:
        c = json.loads((folder / "config.json").read_text())
        config_edit(c)
        (folder / "config.json").write_text(json.dumps(c))
    return lambda: fp.hf.load(folder), folder / "model.safetensors"


def _ckpt_retyped(saved, tmp_path, key, dtype):
    step, folder = _checkpoint(saved, tmp_path)
    t = _retype(folder / "rank-00000.safetensors", key, dtype)
    _edit_meta(folder, lambda m: [pc.update(crc=crc(t)) for pc in m["pieces"] if pc["key"] == key] and None,
               reseal=True)  # the CRC and the checksum agree with the new file: only the dtype is wrong
    return lambda: step.load(folder.parent), folder / "rank-00000.safetensors"


Q = "model.layers.0.self_attn.q_proj.weight"
CONVERT = "pass dtype=torch.float32 (or the dtype you want) to fp.hf.load to convert every tensor explicitly"


@pytest.mark.parametrize("make, message", [
    (lambda h, s, t: _hf_retyped(h, t, Q, torch.float16),
     f"tensor '{Q}' is float16, but config.json's 'dtype' is float32: {CONVERT}"),
    (lambda h, s, t: _hf_retyped(h, t, Q, torch.bfloat16, lambda c: c.pop("dtype")),
     f"tensor '{Q}' is bfloat16, but the checkpoint's other 20 tensors are float32: {CONVERT}"),
    (lambda h, s, t: _hf_retyped(h, t, "model.norm.weight", torch.float16,
                                 lambda c: (c.pop("dtype"), c.update(torch_dtype="float32"))),
     f"tensor 'model.norm.weight' is float16, but config.json's 'torch_dtype' is float32: {CONVERT}"),
    (lambda h, s, t: _ckpt_retyped(s, t, "param/embed", torch.float16),
     "tensor 'param/embed' is stored as float16, but meta.json records 'param/embed' as float32"),
    (lambda h, s, t: _ckpt_retyped(s, t, "opt/0.mu.embed", torch.bfloat16),
     "tensor 'opt/0.mu.embed' is stored as bfloat16, but meta.json records 'opt/0.mu.embed' as float32"),
])
def test_a_tensor_in_another_dtype_is_named_with_its_file(hf_folders, saved, tmp_path, make, message):
    load, file = make(hf_folders, saved, tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises((fp.hf.HFError, fp.checkpoint.CheckpointError)) as e:
        load()
    assert str(e.value) == f"{file}: {message}"
    assert _snapshot(tmp_path) == before


def test_a_dtype_asked_for_converts_every_tensor(hf_folders, tmp_path):
    _hf_retyped(hf_folders, tmp_path, Q, torch.float16)
    params, _ = fp.hf.load(tmp_path / "model", dtype=torch.float32)
    assert {x.dtype for _, x in fp.tree.leaves_with_path(params)} == {torch.float32}


def test_an_export_records_the_dtype_its_tensors_are_in(hf_folders, tmp_path):
    params, cfg = fp.hf.load(hf_folders / "llama", dtype=torch.bfloat16)
    fp.hf.save(tmp_path / "out", params, "llama", cfg)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    back, _ = fp.hf.load(tmp_path / "out")
    assert {x.dtype for _, x in fp.tree.leaves_with_path(back)} == {torch.bfloat16}


# ----------------------------------------------------------------- class 6 (e): config.json keys of the wrong type


def _config(edit):
    def make(c):
        out = edit(c)
        return c if out is None else out
    return make


@pytest.mark.parametrize("kind, edit, message", [
    ("llama", lambda c: c.pop("vocab_size") and None,
     ": config key 'vocab_size' is missing, and model 'llama' cannot do without it"),
    ("llama", lambda c: c.update(hidden_size="64"), ": config key 'hidden_size' is '64' (a string), expected an integer"),
    ("llama", lambda c: c.update(rms_norm_eps="1e-6"),
     ": config key 'rms_norm_eps' is '1e-6' (a string), expected a number"),
    ("llama", lambda c: c.update(tie_word_embeddings="false"),
     ": config key 'tie_word_embeddings' is 'false' (a string), expected true or false"),
    ("gpt2", lambda c: c.pop("n_embd") and None, ": config key 'n_embd' is missing, and model 'gpt2' cannot do without it"),
    ("gpt2", lambda c: c.update(n_head="4"), ": config key 'n_head' is '4' (a string), expected an integer"),
    ("gpt2", lambda c: c.update(n_inner=256.0), ": config key 'n_inner' is 256.0 (a number), expected an integer or null"),
    ("gpt2", lambda c: [c], " holds an array, not an object of config keys: is it a model's config.json?"),
    ("llama", lambda c: "llama", " holds a string, not an object of config keys: is it a model's config.json?"),
])
def test_a_config_json_key_of_the_wrong_type_is_named(hf_folders, tmp_path, kind, edit, message):
    folder = tmp_path / "model"
    shutil.copytree(hf_folders / kind, folder)
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(_config(edit)(c)))
    before = _snapshot(tmp_path)
    with pytest.raises(fp.hf.HFError) as e:
        fp.hf.load(folder)
    assert str(e.value) == f"{folder / 'config.json'}{message}"
    assert _snapshot(tmp_path) == before


def test_the_run_folders_files_are_never_written_through_a_symbolic_link(tmp_path):
    """Issue 46, BAD 1-3: a link where funcpar writes (dangling or to someone's file) is replaced by a new file when
    funcpar writes the file whole, refused when it appends; a checkpoint saved while a link is planted at
    checkpoints/.latest.tmp leaves the link's target as it was."""
    from funcpar.io.atomic import open_own

    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").symlink_to(victim)
    (run / "loss.png").symlink_to(tmp_path / "outside.png")  # dangling: writing through would create it
    with open_own(run / "config.json") as fh:
        fh.write("{}")
    with open_own(run / "loss.png", "wb") as fh:
        fh.write(b"png")
    assert victim.read_text() == "mine" and not (tmp_path / "outside.png").exists()
    assert not (run / "config.json").is_symlink() and (run / "config.json").read_text() == "{}"
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError, match=r"metrics.jsonl is a symbolic link \(to .*victim.txt\): funcpar does not write "
                                      r"through links in its run folder; remove it"):
        open_own(run / "metrics.jsonl", "a")
    assert victim.read_text() == "mine"
    step, state = tiny_step(fp.Mesh())
    ckpts = tmp_path / "ckpts"
    step.save(ckpts / "step-1", state)
    (ckpts / ".latest.tmp").symlink_to(victim)
    step.save(ckpts / "step-2", state)
    assert victim.read_text() == "mine" and (ckpts / "latest").read_text() == "step-2\n"


@pytest.mark.subprocess
def test_a_run_refuses_links_in_its_folder_before_writing_anything(tmp_path):
    import os
    import subprocess
    import sys

    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").symlink_to(victim)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "funcpar", "train", "--model", "llama-micro", "--mesh", "1", "--steps",
                        "1", "--eval-every", "0", "--out", "out", "--resume"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and p.stderr.startswith(
        f"funcpar: {os.path.join('out', 'metrics.jsonl')} is a symbolic link (to {victim}): funcpar writes only its "
        f"own files in the run folder, not through links"), p.stderr
    assert victim.read_text() == "mine" and sorted(os.listdir(tmp_path / "out")) == ["metrics.jsonl"]


def test_a_funcpar_folder_is_replaced_only_by_the_same_kind_of_write_for_the_same_run(tmp_path):
    """Issue 46, BAD 5: a checkpoint is not replaced by an export, nor by another run's checkpoint; an export not by
    a checkpoint; convert refuses a destination that is its source or inside it; every refusal leaves the files as
    they were, and the same run saving again (a resumed run re-saving its step) still replaces its own."""
    from funcpar.cli import main as cli

    step, state = tiny_step(fp.Mesh())
    ckpts = tmp_path / "run" / "checkpoints"
    step.save(ckpts / "step-5", state)
    other, other_state = tiny_step(fp.Mesh())  # another run: another run id
    fp.hf.save(tmp_path / "hf", step.gather_params(state), "llama", SMALL["llama"]())
    before = _snapshot(tmp_path)
    with pytest.raises(fp.checkpoint.CheckpointError, match=r"step-5 is a funcpar checkpoint of another run \("):
        other.save(ckpts / "step-5", other_state)
    with pytest.raises(fp.hf.HFError, match=r"step-5 is a funcpar checkpoint; refusing to replace it with a "
                                            r"transformers folder funcpar exported"):
        fp.hf.save(ckpts / "step-5", step.gather_params(state), "llama", SMALL["llama"]())
    with pytest.raises(fp.checkpoint.CheckpointError, match=r"hf is a transformers folder funcpar exported; "
                                                            r"refusing to replace it with a funcpar checkpoint"):
        step.save(tmp_path / "hf", state, latest=False)
    for src, dst in ((ckpts / "step-5", ckpts / "step-5"), (ckpts, ckpts / "step-5")):
        with pytest.raises(SystemExit, match=r"the destination is the source or inside it"):
            cli.convert([str(src), str(dst)])
    assert _snapshot(tmp_path) == before
    step.save(ckpts / "step-5", state)  # the same run: its own checkpoint, replaced


def test_convert_takes_a_run_folder_and_gives_the_export_a_tokenizer(tmp_path):
    """Issue 45, item 8: `funcpar convert RUN_FOLDER OUT` exports the run's latest checkpoint (its config.json is
    funcpar's options, not a model's), and `--tokenizer` puts the tokenizer's files in the export."""
    import json

    from funcpar.cli import main as cli

    cfg = SMALL["llama"](vocab_size=264)  # (the byte tokenizer's ids fit)
    run = tmp_path / "run"
    model = fp.get_model("llama")
    specs = model.specs(cfg, fp.Mesh())
    big = fp.compile_step(model.loss_fn(cfg, fp.Mesh()), specs, mesh=fp.Mesh(), optimizer=fp.optim.sgd(0.1))
    big_state = big.init(model.init(cfg, seed=1))
    big.save(run / "checkpoints" / "step-1", big_state, extra={"model": "llama", "config": cfg.to_hf()})
    (run / "config.json").write_text(json.dumps({"steps": 1, "model": "llama-micro"}))
    (run / "metrics.jsonl").write_text("")
    cli.convert([str(run), str(tmp_path / "out"), "--tokenizer", "byte"])
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files and "config.json" in files
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(got["model.embed_tokens.weight"], big_state.params["embed"])
