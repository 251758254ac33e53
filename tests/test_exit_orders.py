"""Issue 56, item 1: no rank aborts at or after exit in any start-up and tear-down order a user can write (the
program's own ``init_process_group`` before the mesh or the mesh's, ``destroy_process_group`` or not, an exception on
one rank). The suite's short form of scripts/exit_stress.py: one torchrun job of 2 ranks per order beside a busy
process; the note of issue 56 gives the long form's settings and counts."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.mark.subprocess
def test_every_start_up_and_tear_down_order_ends_without_an_abort(capsys):
    import exit_stress

    assert exit_stress.main(["--runs", "1", "--world", "2", "--mesh", "tp=2", "--load", "1", "--timeout", "240"]) == 0
    out = capsys.readouterr().out
    assert out.count("0 aborted, 0 ended otherwise") == len(exit_stress.ORDERS), out


def test_the_mesh_module_imports_dynamo_before_a_program_can_start_a_group():
    """The cause: torch._dynamo imported once a group exists holds references to it past destroy_process_group
    (its gloo threads then abort the rank at exit); funcpar imports it first, outside its own command line."""
    import subprocess

    code = ("import sys, funcpar, torch.distributed as dist; "
            "print('torch._dynamo' in sys.modules, dist.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split()
    assert out == ["True", "False"]
