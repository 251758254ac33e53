"""`funcpar train` as a user runs it (bare, and under torchrun: the same losses), --resume, plan, convert,
config files, the examples, and the modules the CLI wires together (generate, plot, planning)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import funcpar as fp
from funcpar.cli import main as cli
from funcpar.cli import options
from funcpar.cli.generate import greedy
from funcpar.cli.planning import memory_plan, sharding_table
from funcpar.cli.plot import plot_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "llama-micro", "--global-batch", "8", "--seq-len", "32", "--schedule", "constant", "--lr", "3e-3",
        "--eval-every", "3", "--save-every", "3", "--log-every", "1"]


def run(args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def bare_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bare"))
    stdout = run(["-m", "funcpar", "train", *TINY, "--steps", "6", "--out", out])
    return out, stdout


def test_bare_train_writes_everything_and_the_loss_falls(bare_run):
    tf = pytest.importorskip("transformers")

    out, stdout = bare_run
    assert "funcpar train: llama (funcpar's built-in model) on Mesh(pp=1, dp=2, tp=2) (4 process(es), cpu)" in stdout
    assert "layers.*.wq (x2)" in stdout and "P('tp', None)" in stdout  # the sharding table
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["loss"] < rows[0]["loss"] and "eval_loss" in rows[2] and "eval_ppl" in rows[5]
    assert open(os.path.join(out, "loss.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert open(os.path.join(out, "checkpoints", "latest")).read().strip() == "step-6"
    model = tf.AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))
    ids = torch.tensor([list(b"3+4=\n")])
    gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=256)
    assert gen.shape[1] > ids.shape[1]
    # 6 steps have not learnt the task: no answer check (the 300-step runs of test_cli_run.py show one)
    assert "greedy answers" not in stdout and "answers to the built-in task are checked after 100 steps" in stdout


@pytest.mark.subprocess
def test_torchrun_and_bare_give_the_same_losses(bare_run, tmp_path):
    out, _ = bare_run
    out2 = str(tmp_path / "torchrun")
    run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "funcpar", "train", *TINY,
         "--steps", "6", "--out", out2])
    assert losses(out2) == losses(out)


@pytest.mark.subprocess
def test_two_torchrun_agents_train_as_one_node_and_resume_on_one_node(bare_run, tmp_path):
    # multi-node as torchrun runs it: two agents (--nnodes 2, c10d rendezvous) of 2 ranks each on localhost; the
    # ranks on the second agent are global ranks 2-3 but local ranks 0-1 (each node's own devices)
    import socket

    out, _ = bare_run
    out2 = str(tmp_path / "two-nodes")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("RANK", None)
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two",
                                "-m", "funcpar", "train", *TINY, "--steps", "3", "--out", out2],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    done = [a.communicate(timeout=300) for a in agents]
    for a, (o, e) in zip(agents, done, strict=True):
        assert a.returncode == 0, o[-2000:] + e[-3000:]
    assert "funcpar train: llama (funcpar's built-in model) on Mesh(pp=1, dp=2, tp=2) (4 process(es), cpu)" in \
        "".join(o for o, _ in done)
    assert losses(out2) == losses(out)[:3]  # the same global ranks, the same numbers, bit for bit
    stdout = run(["-m", "funcpar", "train", *TINY, "--steps", "6", "--out", out2, "--resume"])  # one node now
    assert "resumed from" in stdout and "at step 3" in stdout
    assert losses(out2) == losses(out)  # resumed: the same batches, the same state, the same losses bit for bit


def test_plan_prints_table_and_memory(capsys):
    cli.main(["plan", "--mesh", "tp=4,dp=2", "--model", "llama-tiny"])
    text = capsys.readouterr().out
    assert "llama on Mesh(pp=1, dp=2, tp=4): 855,168 parameters" in text
    assert "layers.*.wk (x4)" in text and "P()" in text  # 2 kv heads < tp=4: k/v replicated
    model = fp.get_model("llama")
    like = model.init(model.config(options.BUILTIN_MODELS["llama-tiny"]), device="meta")
    n = sum(x.numel() for _, x in fp.tree.leaves_with_path(like))
    opt_mib = float(text.split("optimizer state ")[1].split(" MiB")[0])
    assert abs(opt_mib - 2 * 4 * n / 8 / 2**20) < 0.05 * (2 * 4 * n / 8 / 2**20)  # AdamW state / (tp*dp)


def test_config_file_and_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('steps = 7\nmesh = "dp=2"\nlr = 0.5\n')
    opts = options.read_options(["--config", str(f), "--lr", "0.25"], "train")
    assert (opts["steps"], opts["mesh"], opts["lr"], opts["seq_len"]) == (7, "dp=2", 0.25, options.DEFAULTS["seq_len"])
    f.write_text('stepz = 7\n')
    with pytest.raises(SystemExit, match="unknown option"):
        options.read_options(["--config", str(f)], "train")
    with pytest.raises(SystemExit, match="bad --mesh 'tp2'"):
        options.parse_mesh("tp2")
    with pytest.raises(SystemExit, match="bad --mesh 'tp=2,2=dp'"):
        options.parse_mesh("tp=2,2=dp")
    with pytest.raises(SystemExit, match="bad --mesh 'tp=two'"):
        options.parse_mesh("tp=two")
    assert options.parse_mesh("tp=2,dp=2,ep=2") == {"tp": 2, "dp": 2, "ep": 2}  # any axis name
    assert options.parse_mesh("1") == {} == options.parse_mesh("")


def test_every_option_is_declared_once_with_help_a_typed_default_and_its_flag_in_help(capsys):
    """Issue 54, item 6: each option is one field of a typed group; the parsers, --help, DEFAULTS and the checks are
    made from those fields."""
    import dataclasses
    import typing

    fields = [(g, f) for g in options.GROUPS for f in dataclasses.fields(g)]
    names = [f.name for _, f in fields]
    assert len(names) == len(set(names)) == len(options.OPTIONS)  # (no option in two groups)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split("\n\n", 1)[1].split())  # (after the usage line)
    actions = options.parser("train")._option_string_actions
    for group, f in fields:
        kind = typing.get_type_hints(group)[f.name]
        assert kind in (str, int, float, bool) and type(f.default) is kind, f.name
        assert f.metadata["help"].strip(), f.name
        flag = "--" + f.name.replace("_", "-")
        assert f"{group.__doc__}:" in text and flag in text, flag
        shown = f"{flag}, --no-{f.name.replace('_', '-')}" if kind is bool else f"{flag} {kind.__name__.upper()}"
        assert shown in text, shown
        assert actions[flag].help.startswith(f.metadata["help"]), flag
        assert actions[flag].help.endswith(f"(default: {f.default})") == (f.default != ""), flag
        low, high = f.metadata["at_least"], f.metadata["at_most"]
        assert low is None or low <= f.default <= (float("inf") if high is None else high), f.name
        assert not f.metadata["choices"] or f.default in f.metadata["choices"], f.name
    # the generated parser's defaults are the dataclasses' (a group built bare holds its defaults)
    defaults = {k: v for g in options.GROUPS for k, v in dataclasses.asdict(g()).items()}
    assert options.read_options([], "train") == defaults == dict(options.DEFAULTS)
    assert list(defaults) == list(options.DEFAULTS) == list(options.OPTIONS)
    assert options.read_options([], "plan") == defaults
    plan = {a.dest for a in options.parser("plan")._actions} - {"help", "config", "debug"}
    assert plan == {o.name for o in options.OPTIONS.values() if o.plan} and {"zero", "mesh"} <= plan
    assert "steps" not in plan and "resume" not in plan
    assert {a.dest for a in options.parser("train")._actions} - {"help", "config", "debug"} == set(defaults)
    readme = open(os.path.join(ROOT, "README.md")).read()
    synopsis = readme[readme.index("funcpar train [--config"):readme.index("funcpar plan --model")]
    missing = [o.flag for o in options.OPTIONS.values() if o.flag not in synopsis and
               o.flag.replace("--", "--no-", 1) not in synopsis]
    assert not missing, f"README's `funcpar train` synopsis lacks {missing}"
    # the declared rules are the checks: a choice, a range, a check
    for argv, message in ((["--compile", "maybe"], "--compile 'maybe': expected one of auto, on, off"),
                          (["--zero", "4"], "--zero 4: must be a number at least 0 and at most 3"),
                          (["--keep", "0"], "--keep 0: must be a number at least 1"),
                          (["--heartbeat", "1"], "--heartbeat 1.0: a rank is declared stuck")):
        with pytest.raises(SystemExit, match="^funcpar: " + message.replace("(", r"\(")):
            options.read_options(argv, "train")


def test_plan_on_a_mesh_with_another_axis(capsys):
    cli.main(["plan", "--mesh", "dp=2,ep=2,tp=2", "--model", "llama-micro"])
    text = capsys.readouterr().out
    assert "llama on Mesh(" in text and "ep=2" in text and "per rank (zero=1, adamw)" in text


def test_remat_needs_the_capability():
    gpt2 = fp.get_model("gpt2")
    assert fp.get_model("llama").remat and not gpt2.remat
    with pytest.raises(SystemExit, match="--remat is not supported by model 'gpt2'"):
        options.build_step({**options.DEFAULTS, "remat": True}, gpt2, None, fp.Mesh(), None)


def test_unknown_model_type_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(SystemExit, match="no model is registered for 'no-such-model'"):
        cli.main(["plan", "--mesh", "1", "--model", str(tmp_path)])


def test_convert_round_trip(tmp_path):
    from hf_fixtures import assert_identical, checkpoint_tensors, make_checkpoint

    make_checkpoint("qwen2", str(tmp_path / "hf"))
    cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt")])
    cli.main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "back")])
    assert_identical(checkpoint_tensors(tmp_path / "hf"), checkpoint_tensors(tmp_path / "back"))
    # a parameters-only checkpoint starts training with a fresh optimizer
    params, cfg = fp.hf.load(tmp_path / "hf")
    model = fp.get_model(cfg.model_type)
    step = fp.compile_step(model.loss_fn(cfg, fp.Mesh()), model.specs(cfg), mesh=fp.Mesh(),
                           optimizer=fp.optim.adamw(1e-3))
    step.init(model.init(cfg, seed=5))
    state, extra = step.load(tmp_path / "ckpt")
    assert state.step == 0 and extra["model"] == "qwen2"
    # adamw's chain state: (ScaleByAdamState(count, mu, nu), ScaleByLearningRateState(count)), both counts at 0
    assert [int(s.count) for s in state.opt_state if "count" in s._fields] == [0, 0]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fp.tree.leaves_with_path(state.params), fp.tree.leaves_with_path(params), strict=True))
    state, m = step(state, {"input_ids": torch.randint(0, 128, (2, 8))})
    assert m["step"] == 1


@pytest.mark.subprocess
def test_examples_run_as_written(tmp_path):
    tf = pytest.importorskip("transformers")

    from hf_fixtures import make_checkpoint

    out = str(tmp_path / "tiny")
    stdout = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                  "examples/train_tiny_llama.py", "--steps", "4", "--out", out])
    assert "final loss" in stdout
    tf.AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))
    assert tf.AutoTokenizer.from_pretrained(os.path.join(out, "hf")).encode("2+3") == list(b"2+3")  # pipeline() loads
    make_checkpoint("llama_bytes", str(tmp_path / "base"))
    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps({"type": "instruct", "instruct": f"say {w}", "output": w}) for w in ["hi", "yo", "ok", "no"] * 4))
    stdout = run(["examples/finetune_hf.py", "--model", str(tmp_path / "base"), "--data", str(sft), "--steps", "3",
                  "--global-batch", "4", "--seq-len", "16", "--out", str(tmp_path / "ft"), "--tokenizer", "byte"])
    assert "exported" in stdout
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ft")
    assert tf.AutoTokenizer.from_pretrained(tmp_path / "ft").encode("say hi") == list(b"say hi")


@pytest.mark.subprocess
def test_progress_bar_on_a_terminal(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal has a size
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("RANK", None)
    p = subprocess.Popen([sys.executable, "-m", "funcpar", "train", *TINY, "--mesh", "1", "--steps", "3",
                          "--out", str(tmp_path / "o")], cwd=ROOT, env=env, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=300) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "train: 100%" in text and "3/3" in text and "loss=" in text  # tqdm, on rank 0
    assert text.count("step     3/3  loss ") == 1  # the interval line, written above the bar (tests/test_cli_run.py)


@pytest.mark.subprocess
def test_precision_and_remat_flags(tmp_path):
    out = str(tmp_path / "bf16")
    run(["-m", "funcpar", "train", *TINY, "--mesh", "dp=2", "--steps", "4", "--precision", "bf16", "--remat",
         "--out", out])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(rows) == 4 and all("loss_scale" in r for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
    tf = pytest.importorskip("transformers")

    tf.AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))  # the export holds the bf16 weights


def test_greedy_decodes_each_prompt_until_eos():
    # a "model" whose next token is the last one plus 1, with 5 as end of sequence
    def logits_fn(ids):
        return torch.nn.functional.one_hot((ids + 1) % 8, 8).float()

    assert greedy(logits_fn, [[1], [3], [0, 2], [6]], eos=5, max_new=3) == [[2, 3, 4], [4], [3, 4], [7, 0, 1]]


def test_plot_metrics_writes_a_png(tmp_path):
    rows = [{"step": 1, "loss": 2.0, "lr": 1e-3}, {"step": 2, "loss": 1.5, "eval_loss": 1.7, "lr": 2e-3},
            {"step": 3, "loss": 1.2, "lr": 2e-3}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = plot_metrics(tmp_path / "m.jsonl", tmp_path / "loss.png", title="llama on Mesh(dp=2)")
    assert drawn == {"title": "llama on Mesh(dp=2)", "lines": {"train loss": 3, "eval loss": 1, "learning rate": 3}}
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_planning_on_an_abstract_mesh():
    model = fp.get_model("llama")
    mesh = fp.Mesh.abstract(tp=2, dp=2)
    cfg = model.config(options.BUILTIN_MODELS["llama-micro"], mesh)
    like, specs = model.init(cfg, device="meta"), model.specs(cfg, mesh)
    assert "layers.*.wq (x2)" in sharding_table(like, specs, mesh)
    zero0, zero1, zero3 = (memory_plan(like, specs, mesh, zero) for zero in (0, 1, 3))
    assert zero0["params"] == zero1["params"] and zero1["optimizer"] < zero0["optimizer"]
    assert zero3["params"] == zero0["params"] / 2 and zero3["grads"] == zero0["grads"] / 2  # 1/dp of each
    assert abs(zero1["total"] - zero1["params"] - zero1["grads"] - zero1["optimizer"]) < 1e-9


@pytest.mark.subprocess
def test_zero3_from_the_command_line_gives_the_zero1_losses_and_exports(tmp_path):
    outs = {}
    for zero in ("1", "3"):
        outs[zero] = str(tmp_path / f"z{zero}")
        run(["-m", "funcpar", "train", *TINY, "--mesh", "dp=2", "--steps", "3", "--zero", zero, "--out", outs[zero]])
    for a, b in zip(losses(outs["1"]), losses(outs["3"]), strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
    tf = pytest.importorskip("transformers")

    tf.AutoModelForCausalLM.from_pretrained(os.path.join(outs["3"], "hf"))  # exported from the zero=3 parts


@pytest.mark.subprocess
def test_pipeline_stages_from_the_command_line_resume_on_another_mesh(bare_run, tmp_path, capsys):
    out, _ = bare_run
    out2 = str(tmp_path / "pp")
    stdout = run(["-m", "funcpar", "train", *TINY, "--mesh", "pp=2,tp=2", "--micro-batches", "2", "--steps", "3",
                  "--out", out2])
    # the default cut weighs the halves of a layer: llama-micro's head is light, so layer 1's attention joins stage 0
    assert "pp rank 0: stage 0: embed + layer 0 + layer 1 attention\n" in stdout
    assert "pp rank 1: stage 1: layer 1 mlp + head\n" in stdout
    rows = [json.loads(line) for line in open(os.path.join(out2, "metrics.jsonl"))]
    assert all(0 <= r["bubble"] < 1 for r in rows)
    stdout = run(["-m", "funcpar", "train", *TINY, "--mesh", "tp=2,dp=2", "--steps", "6", "--out", out2, "--resume"])
    assert "at step 3" in stdout
    for a, b in zip(losses(out2), losses(out), strict=True):  # the same batches through stages: the tp=2,dp=2 run's losses
        assert abs(a - b) <= 1e-5 * abs(b)
    cli.main(["plan", "--mesh", "pp=2,tp=2", "--model", "llama-tiny", "--micro-batches", "4"])
    text = capsys.readouterr().out
    assert "pp rank 1: stage 1: layers 2-3 + head" in text and "1f1b over 4 micro-batches: planned bubble 20.0%" in text
    cli.main(["plan", "--mesh", "pp=2,tp=2", "--model", "llama-tiny", "--micro-batches", "4", "--parts", "2.5,1.5"])
    text = capsys.readouterr().out
    assert "pp rank 0: stage 0: embed + layers 0-1 + layer 2 attention\npp rank 1: stage 1: layer 2 mlp + layer 3 + head" in text
    cli.main(["plan", "--mesh", "pp=2,tp=2", "--model", "llama-tiny", "--micro-batches", "4", "--pipeline", "zb"])
    assert "zb over 4 micro-batches: planned bubble 7.7%" in capsys.readouterr().out  # traced through the split
    # an interleaved plan: rank 0 receives carries (its second chunk's), in the plan's meta tensors
    cli.main(["plan", "--mesh", "pp=2,tp=2", "--model", "llama-tiny", "--micro-batches", "4", "--pipeline",
              "interleaved", "--chunks", "2"])
    assert "interleaved over 4 micro-batches: planned bubble" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"bad --parts entry 'x': expected layer counts such as 3,5 or 2.5,1.5"):
        cli.main(["plan", "--mesh", "pp=2", "--model", "llama-tiny", "--parts", "2.5,x"])




def test_a_bf16_hf_folder_trains_from_float32_weights(tmp_path):
    """Most Hub checkpoints are bf16: `funcpar train` reads them into float32, the parameters at --precision fp32 and
    the masters under bf16 (bf16 weights and optimizer state would lose every update below bf16's resolution)."""
    transformers = pytest.importorskip("transformers")

    from hf_fixtures import CONFIGS

    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    llama = fp.get_model("llama")
    opts = {**options.DEFAULTS, "model": str(tmp_path / "bf16")}
    cfg = llama.config(json.loads((tmp_path / "bf16" / "config.json").read_text()), fp.Mesh())
    params = options.build_params(opts, llama, cfg, llama.specs(cfg), fp.Mesh())
    leaves = [x for _, x in fp.tree.leaves_with_path(params)]
    assert leaves and all(x.dtype == torch.float32 for x in leaves)
    want = model.model.layers[0].self_attn.q_proj.weight.float()
    assert torch.equal(params["layers"][0]["wq"], want)  # bf16 values, exactly, in float32


@pytest.mark.subprocess
def test_the_readmes_own_model_section_is_the_example_and_it_verifies_on_tp2(tmp_path):
    """README's "Your own model" code is examples/own_model.py as it stands; under torchrun on tp=2 fp.verify
    passes and the step trains."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## Your own model"):readme.index("## The command line")]
    code = section[section.index("```python\n") + 10:section.index("```\n\nA model that")]
    example = open(os.path.join(ROOT, "examples", "own_model.py")).read()
    assert code == example[example.index("import os"):]
    stdout = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "examples/own_model.py"])
    assert "verified on Mesh(pp=1, dp=1, tp=2); loss " in stdout
