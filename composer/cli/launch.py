"""``composer launch --nproc-per-node N COMMAND ...``: any composer command on N local processes.

torchrun's job (torch's elastic agent underneath: a standalone rendezvous on localhost, a free
port, no restarts), with the CLI's promises kept. Each rank runs ``composer COMMAND ...`` as under
``torchrun --standalone``; rank 0's stdout and stderr stream as they do there, the other ranks'
stderr goes to a log (their tracebacks and warnings would repeat rank 0's). A failing rank hands
its one-line error to the launcher (:func:`hand_over`), which prints ``rank R: <line> (exit code
C)`` for each and exits with the ranks' code: 2 for a user error, 3 for a halted run, 130 for an
interrupt during start-up. SIGINT and SIGTERM are forwarded once per signal to every rank, so
Ctrl-C finishes the step, saves and exits 0 as it does on one process (a second one exits at
once), where torch's agent would stop the ranks after 30 s and print its own traceback.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ENV = "COMPOSER_LAUNCH_DIR"
"""The folder where each failing rank leaves its one-line report for the launcher."""
GRACE_S = 10.0
"""How long a failing rank waits for its peers' reports. torch's agent stops every rank as soon
as one exits non-zero, so without this wait a mistake every rank makes (a bad flag) would be
reported by whichever rank happened to be fastest, the others dying of the agent's SIGTERM."""


def hand_over(line: str, code: int) -> bool:
    """Under ``composer launch``: leave this rank's one-line error (and the exit code it is
    about to return) for the launcher, which prints it; False when not launched so."""
    folder, rank = os.environ.get(ENV), os.environ.get("RANK")
    if not folder or rank is None or not os.path.isdir(folder):
        return False
    path = Path(folder, f"rank-{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"line": line, "code": code, "time": time.time()}))
    os.replace(tmp, path)  # the launcher never reads half a report
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and not all(
            Path(folder, f"rank-{r}.json").exists() for r in range(world)):
        time.sleep(0.05)
    return True


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def _rank_main(argv: list[str]) -> int:
    """One rank: the CLI, and for a crash (not a user error) its one line for the launcher
    before Python prints the traceback (to the terminal on rank 0, to the log on the others)."""
    from composer.cli import main

    try:
        return main(argv)
    except Exception as exc:
        hand_over(_one_line(exc), 1)
        raise


def _children() -> list[int]:
    """This process's children: the ranks (torch's agent starts each in its own session, so a
    terminal's Ctrl-C reaches only the launcher, which forwards it)."""
    me = os.getpid()
    if not os.path.isdir("/proc"):
        out = subprocess.run(["pgrep", "-P", str(me)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path("/proc", name, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # the field after the command name
            pids.append(int(name))
    return pids


class _Forward:
    """SIGINT / SIGTERM: sent on to every rank, once per signal received."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}
        self.count = 0
        self._old = {sig: signal.signal(sig, self._handle)
                     for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        for pid in _children():
            for _ in range(self.count - self.sent.get(pid, 0)):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    break
            self.sent[pid] = self.count

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _quiet_torch_logs() -> None:
    """The agent logs each step of its work and each stopped rank; the summary says what
    matters, and a launcher error is raised, so nothing of it is lost."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logger = logging.getLogger(name)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False


def _last_line(path: Path) -> str | None:
    """The last line a rank wrote to its stderr log: its error when it left no report."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln]
    return lines[-1][:300] if lines else None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def summarise(reports: dict[int, dict], failures: dict[int, Any],
              stderrs: dict[int, str | None]) -> tuple[list[str], int]:
    """One line per failing rank and the launcher's exit code: the code of the first report, or
    else of the first failure (a signal ``s`` as ``128 + s``). A rank without a report that died
    of SIGTERM or SIGKILL while another reported was stopped by the agent: not a failure."""
    lines = {r: f"rank {r}: {rep['line']} (exit code {rep['code']})" for r, rep in reports.items()}
    for r, f in failures.items():
        if r in reports or (reports and f.exitcode in (-signal.SIGTERM, -signal.SIGKILL)):
            continue
        what = stderrs.get(r)
        if f.exitcode < 0:
            what = f"killed by {_signal_name(f.exitcode)}" + (f" ({what})" if what else "")
        lines[r] = f"rank {r}: {what or 'no error reported'} (exit code {f.exitcode})"
    if reports:
        code = min(reports.values(), key=lambda rep: rep["time"])["code"]
    elif failures:
        first = min(failures.values(), key=lambda f: f.timestamp).exitcode
        code = 128 - first if first < 0 else first
    else:
        code = 0
    return [lines[r] for r in sorted(lines)], code


def _read_reports(folder: Path) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text())
            for p in folder.glob("rank-*.json")}


def _config(nproc: int, logs: Path) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    # torchrun --standalone's rendezvous: c10d on localhost, port 0 (the store picks a free one)
    return LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
        logs_specs=DefaultLogsSpecs(log_dir=str(logs),
                                    redirects={r: Std.ERR for r in range(1, nproc)}),
        # SIGINT and SIGTERM are ours (forwarded, then we wait for the save); the agent's
        # handler would stop the ranks after its shutdown timeout and raise
        signals_to_handle="SIGHUP,SIGQUIT")


def launch(nproc: int, argv: list[str], log_dir: str | None = None) -> int:
    """Run ``composer ARGV`` on ``nproc`` local ranks; the exit code is the ranks'."""
    from composer.cli.base import UsageError

    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be at least 1; got {nproc}")
    if not argv or argv[0].startswith("-") or argv[0] == "launch":
        raise UsageError("give the composer command to run after the launcher's options, "
                         "e.g. composer launch --nproc-per-node 2 train --config debug")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _quiet_torch_logs()
    # each rank's thread count: composer.threads divides the CPUs by LOCAL_WORLD_SIZE
    folder = Path(tempfile.mkdtemp(prefix="composer-launch-"))
    config = _config(nproc, Path(log_dir) if log_dir else folder / "logs")
    os.environ[ENV] = str(folder)
    forward = _Forward()
    failures: dict[int, Any] = {}
    try:
        elastic_launch(config, sys.executable)("-m", "composer.cli.launch", *argv)
    except ChildFailedError as exc:
        failures = exc.failures
    except SignalException as exc:  # SIGHUP / SIGQUIT: the agent stopped the ranks
        print(f"composer: launch stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    except Exception as exc:  # the rendezvous or the agent itself, not a rank
        print(f"composer: error: launch failed: {_one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        forward.close()
        os.environ.pop(ENV, None)
        reports = _read_reports(folder)
        logs = list(Path(config.logs_specs.root_log_dir).glob(f"{config.run_id}_*"))
        stderrs = {r: _last_line(next(iter(logs)) / "attempt_0" / str(r) / "stderr.log")
                   for r in range(1, nproc)} if logs else {}
        shutil.rmtree(folder, ignore_errors=True)
    lines, code = summarise(reports, failures, stderrs)
    for line in lines:
        print(line, file=sys.stderr)
    return code


if __name__ == "__main__":  # one rank, as the launcher starts it
    sys.exit(_rank_main(sys.argv[1:]))
