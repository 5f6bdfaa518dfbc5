"""The garbage collector paused while planning (`autopar.search.heap`), and resumed after."""

from __future__ import annotations

import gc

from autopar.cli.main import main
from autopar.search.heap import gc_paused


def test_collection_resumes_as_the_outermost_pause_found_it():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner pause does not resume it under the outer one
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # paused by the caller: left paused
    finally:
        gc.enable()


def test_collection_resumes_after_an_error_unless_the_process_is_ending():
    try:
        with gc_paused():
            raise ValueError("boom")
    except ValueError:
        pass
    assert gc.isenabled()
    try:
        with gc_paused(resume=False):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_planning_command_leaves_collection_on_for_a_library_caller(capsys):
    """`main` from Python (not the `autopar` command, which ends the process) resumes collection, also when the
    command fails."""
    assert main(["estimate", "gpt3-125m", "--gpus", "2", "--batch", "4", "--json"]) == 0
    assert gc.isenabled()
    assert main(["estimate", "gpt3-125m", "--gpus", "3", "--tp", "2", "--batch", "4"]) == 2
    assert gc.isenabled()
    capsys.readouterr()
