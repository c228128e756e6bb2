"""`composer launch`: at 2 gloo ranks on the CPU a mistake is one line per rank and exit code 2,
a short run prints what torchrun's prints, and SIGINT to the launcher saves and exits 0 (where
torchrun ends each in its own 30-line traceback and exit code 1)."""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

import composer.cli
from composer.cli import launch as launcher
from composer.cli import main

COMPOSER = [sys.executable, "-m", "composer"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "composer"]
LAUNCH = [*COMPOSER, "launch", "--nproc-per-node", "2"]
DEBUG = ["train", "--config", "debug", "--log-every", "1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(cmd, cwd):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=ENV, timeout=400)


@pytest.mark.slow
def test_a_mistake_is_one_line_per_rank_and_exit_2(tmp_path, capsys):
    mistake = [*DEBUG, "--steps", "2", "--lr", "-1"]
    assert main(mistake) == 2
    alone = capsys.readouterr().err.strip()  # the line one process prints
    assert alone.startswith("composer: error: ") and "--lr" in alone
    proc = run([*LAUNCH, *mistake], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"rank {r}: {alone} (exit code 2)" for r in (0, 1)]
    assert proc.stdout == ""


@pytest.mark.slow
def test_a_run_prints_what_torchrun_prints(tmp_path):
    cmd = [*DEBUG, "--steps", "3"]
    ours, theirs = run([*LAUNCH, *cmd], tmp_path), run([*TORCHRUN, *cmd], tmp_path)
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr

    def steady(out):  # the throughput is the machine's
        return re.sub(r"tok/s +[\d,.]+", "tok/s N", out)

    assert len(ours.stdout.splitlines()) == 3
    assert steady(ours.stdout) == steady(theirs.stdout)
    assert ours.stderr == ""


@pytest.mark.slow
def test_sigint_to_the_launcher_saves_and_exits_0(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*LAUNCH, *DEBUG, "--steps", "400", "--save", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=ENV)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout])
    reader.start()
    err = []
    err_reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))
    err_reader.start()
    out = []
    try:
        deadline = time.monotonic() + 300
        while not out or not out[-1].startswith("step"):  # the ranks are training
            assert time.monotonic() < deadline and proc.poll() is None, "no step in time"
            try:
                out.append(lines.get(timeout=1.0))
            except queue.Empty:
                continue
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:  # SIGTERM goes on to the ranks, which stop; then make sure
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        reader.join(timeout=10)
        err_reader.join(timeout=10)
    while not lines.empty():
        out.append(lines.get())
    err = "".join(err)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "rank" not in err, err
    step = int([line for line in out if line.startswith("step")][-1].split()[1])
    assert 1 <= step < 400  # stopped early, after the step it was in
    assert f"saved step {step} to {run_dir}\n" in out
    assert (run_dir / "latest").read_text().strip() == f"step-{step:08d}"


def test_a_crash_hands_its_line_over_then_raises(tmp_path, monkeypatch):
    def crash(argv):
        raise IndexError("no such layer\nsecond line")

    monkeypatch.setattr(composer.cli, "main", crash)
    monkeypatch.setenv(launcher.ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(launcher, "GRACE_S", 0.2)  # rank 0 never reports here
    with pytest.raises(IndexError):  # Python prints the traceback, exit code 1
        launcher._rank_main(["train"])
    report = launcher._read_reports(tmp_path)
    assert list(report) == [1] and report[1]["code"] == 1
    assert report[1]["line"] == "IndexError: no such layer"


def failure(exitcode, local_rank, timestamp=0.0):
    return SimpleNamespace(exitcode=exitcode, local_rank=local_rank, timestamp=timestamp)


def test_summary_lines_and_exit_codes():
    reports = {1: {"line": "composer: error: bad", "code": 2, "time": 5.0},
               0: {"line": "RuntimeError: peer gone", "code": 1, "time": 6.0}}
    # rank 2 was stopped by the agent after rank 1's report: not a failure of its own
    lines, code = launcher.summarise(reports, {2: failure(-signal.SIGTERM, 2)}, {})
    assert lines == ["rank 0: RuntimeError: peer gone (exit code 1)",
                     "rank 1: composer: error: bad (exit code 2)"]
    assert code == 2  # the first report's
    # no report: the signal, and the last line of the rank's stderr
    lines, code = launcher.summarise({}, {1: failure(-signal.SIGKILL, 1, 3.0),
                                          0: failure(-signal.SIGTERM, 0, 4.0)},
                                     {1: "Killed"})
    assert lines == [f"rank 0: killed by SIGTERM (exit code {-signal.SIGTERM})",
                     f"rank 1: killed by SIGKILL (Killed) (exit code {-signal.SIGKILL})"]
    assert code == 128 + signal.SIGKILL
    assert launcher.summarise({}, {}, {}) == ([], 0)


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "0", "train"], "--nproc-per-node must be at least 1; got 0"),
    (["--nproc-per-node", "2"], "give the composer command to run after the launcher's options, "
                                "e.g. composer launch --nproc-per-node 2 train --config debug"),
])
def test_launcher_mistakes_are_one_line(argv, message, capsys):
    assert main(["launch", *argv]) == 2
    assert capsys.readouterr().err == f"composer: error: {message}\n"
