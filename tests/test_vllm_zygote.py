"""The vLLM zygote (workbench/adapters/vllm/zygote.py): each run a process of its own, forked from
one that has vLLM imported, so that a run starts in ~2 s, not ~8.

What a run must keep from a fresh `python -c`: its own environment, exit code and output; nothing
a run patches or sets reaches the next; a run that overstays is killed and the next one still runs.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from workbench.adapters.vllm import driver
from workbench.adapters.vllm.server import vllm_python

pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason=f"no vLLM environment at {vllm_python()} (make vllm installs it)")


@pytest.fixture(scope="module")
def zygote():
    z = driver.Zygote({k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")})
    yield z
    z.close()


def test_each_run_is_a_process_of_its_own(zygote):
    code = ("import os, sys, vllm.engine.arg_utils as a\n"
            "print('PID', os.getpid(), 'SEEN', os.environ.get('ZYGOTE_TEST'), 'ARGV', sys.argv[1:])\n"
            "print('PATCHED', getattr(a, 'planted', None))\n"
            "a.planted = 'by this run'\n"
            "sys.stderr.write('to stderr\\n')\n"
            "sys.exit(int(sys.argv[1]))\n")
    one = zygote.run(code, ["3", "x"], dict(os.environ, ZYGOTE_TEST="one"), 60)
    two = zygote.run(code, ["0"], {k: v for k, v in os.environ.items() if k != "ZYGOTE_TEST"}, 60)
    assert one.returncode == 3 and two.returncode == 0
    assert "SEEN one ARGV ['3', 'x']" in one.stdout and "SEEN None ARGV ['0']" in two.stdout
    assert "PATCHED None" in one.stdout and "PATCHED None" in two.stdout     # one run's patch stays in it
    assert one.stderr == "to stderr\n"
    pids = {int(r.stdout.split()[1]) for r in (one, two)}
    assert len(pids) == 2 and zygote.proc.pid not in pids and os.getpid() not in pids


def test_an_exception_is_a_traceback_and_exit_code_1(zygote):
    r = zygote.run("raise ValueError('planted')", [], dict(os.environ), 60)
    assert r.returncode == 1 and "ValueError: planted" in r.stderr


def test_a_run_that_overstays_is_killed_and_the_next_one_runs(zygote):
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run("import time\ntime.sleep(60)", [], dict(os.environ), 1)
    assert zygote.alive()
    assert zygote.run("print('after')", [], dict(os.environ), 60).stdout == "after\n"


def test_pagedkv_vllm_zygote_0_runs_a_fresh_python(monkeypatch):
    monkeypatch.setenv("PAGEDKV_VLLM_ZYGOTE", "0")
    assert driver._zygote(dict(os.environ)) is None
    r = driver._run("import sys\nprint('fresh', sys.argv[1:])", ("a",), dict(os.environ), 120)
    assert r.returncode == 0 and r.stdout.strip() == "fresh ['a']"


def test_a_result_line_is_found_behind_another_threads_unfinished_line(zygote):
    # what CI saw in the soak: a sampler thread's print() wrote its text, the driver's RESULT line went
    # out, and then the sampler's newline: the RESULT did not start a line and the run read as no result
    code = ("import json, sys\n"
            "sys.stdout.write('SAMPLE {\"t\": 1}')\n"
            "sys.stdout.write('RESULT ' + json.dumps({'steps': 7, 'note': 'a } in a string'}) + '\\n')\n"
            "sys.stdout.write('\\nSAMPLE {\"t\": 2}\\n')\n")
    p = zygote.run(code, [], dict(os.environ), 60)
    assert p.returncode == 0
    assert not any(ln.startswith("RESULT ") for ln in p.stdout.splitlines())     # the line as CI had it
    assert driver.result_of(p.stdout) == {"steps": 7, "note": "a } in a string"}
    assert driver.result_of("no result\n") is None
    # a line that only mentions one (a log line) is skipped, not fatal; the real one after it counts
    assert driver.result_of('INFO a RESULT {not json} here\nRESULT {"steps": 3}\n') == {"steps": 3}


def test_a_run_inherits_the_frozen_heap_and_the_compilers_answers(zygote):
    # what the zygote worked out once (zygote.preload) reaches each run from its fork: the run below
    # cannot start a process or hash a file, and the ISA and source keys still come back (the cached
    # answers; without them both raise); the heap it was forked with is frozen for the collector
    code = ("import gc, subprocess\n"
            "import torch._inductor.codecache as cc\n"
            "from torch._inductor.cpu_vec_isa import pick_vec_isa\n"
            "def refuse(*a, **k):\n"
            "    raise RuntimeError('the run worked it out again')\n"
            "subprocess.run = subprocess.check_output = subprocess.Popen = cc.build_code_hash = refuse\n"
            "print('ISA', pick_vec_isa(), 'KEY', len(cc.torch_key()))\n"
            "print('FROZEN', gc.get_freeze_count())\n")
    r = zygote.run(code, [], dict(os.environ), 60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "KEY 32" in r.stdout, r.stdout                                     # torch_key: a sha256
    assert int(r.stdout.split("FROZEN")[1].split()[0]) > 100_000, r.stdout       # vLLM + torch: ~10^6 objects
