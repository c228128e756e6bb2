"""The intra-op thread policy (composer/threads.py): a pure function of the work's size, the
CPUs and OMP_NUM_THREADS, and the commands that apply it."""

import os

import pytest

from composer.threads import WORK_PER_THREAD, available_cpus, intra_op_threads

NO_ENV: dict[str, str] = {}


@pytest.mark.parametrize(
    "n_params, tokens, cpus, expected",
    [
        (419_000, 256, 2, 1),            # the debug recipe: tiny ops, one thread
        (520_000, 4096, 2, 2),           # the shakespeare recipe: both cores of two
        (419_000, 256, 64, 1),           # ... on any machine
        (0, 0, 8, 1),                    # unknown size: one thread, never zero
        (WORK_PER_THREAD, 1, 8, 1),      # one thread's worth
        (WORK_PER_THREAD, 3, 8, 3),      # three threads' worth
        (WORK_PER_THREAD, 3, 2, 2),      # capped by the CPUs
        (10**9, 2048, 16, 16),           # a 1B model on 2,048 tokens: every CPU
        (10**9, 2048, 1, 1),
    ],
)
def test_threads_follow_the_work(n_params, tokens, cpus, expected):
    assert intra_op_threads(n_params, tokens, cpus, NO_ENV) == expected


@pytest.mark.parametrize("work", [(419_000, 256), (10**9, 2048)])
def test_omp_num_threads_wins(work):
    assert intra_op_threads(*work, 16, {"OMP_NUM_THREADS": "3"}) == 3
    assert intra_op_threads(*work, 2, {"OMP_NUM_THREADS": "5"}) == 5
    # values OpenMP ignores are ignored here too: the policy decides
    policy = intra_op_threads(*work, 16, NO_ENV)
    for bad in ("0", "-2", "abc", ""):
        assert intra_op_threads(*work, 16, {"OMP_NUM_THREADS": bad}) == policy


def test_available_cpus_is_the_affinity_shared_by_local_ranks():
    mine = len(os.sched_getaffinity(0))
    assert available_cpus({}) == mine
    assert available_cpus({"LOCAL_WORLD_SIZE": "2"}) == max(1, mine // 2)
    assert available_cpus({"LOCAL_WORLD_SIZE": str(4 * mine)}) == 1


@pytest.mark.slow
def test_the_debug_recipe_gets_one_thread():
    from composer.cli.base import train_work
    from composer.train.engine import resolve

    recipe, _ = resolve(None, "debug", {})
    n_params, tokens = train_work(recipe)
    assert (n_params, tokens) == (419_400, 4 * 64)  # micro-batch 4 x seq 64
    assert intra_op_threads(n_params, tokens, 1024, NO_ENV) == 1


def test_commands_set_and_restore_the_threads(monkeypatch, tmp_path, capsys):
    import torch

    import composer
    from composer import threads
    from composer.cli import main

    asked, applied = [], []
    monkeypatch.setattr(threads, "intra_op_threads", lambda *a: asked.append(a[:2]) or 3)
    real_set = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: applied.append(n) or real_set(n))
    before = torch.get_num_threads()
    assert main(["build", "--pattern", "M*", "--set", "d_model=64", "--set", "vocab_size=64",
                 "--out", str(tmp_path / "ck"), "--json"]) == 0
    capsys.readouterr()
    params = sum(p.numel() for p in composer.load(tmp_path / "ck").parameters())
    assert asked == [(params, 32)]  # build --out: parameters x INIT_TOKENS
    assert applied == [3, before]  # set before the work, put back when main returns
    assert torch.get_num_threads() == before
