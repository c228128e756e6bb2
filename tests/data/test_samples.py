"""GPT-dataset samples, splits, blends and the batches each rank reads; the engine on indexed
data: resume after a change of global batch, validation loss, bad data, memory."""

import json
import subprocess
import sys

import numpy as np
import pytest

from composer.cli import main
from composer.data.blend import Blend, parse_blend
from composer.data.gpt import GPTSamples, split_documents
from composer.data.indexed import DataError, IndexedDataset, IndexedWriter
from composer.train.data import Batches


def write(prefix, docs, dtype=np.uint16):
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d))
    return IndexedDataset(prefix)


@pytest.fixture
def docs(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, rng.integers(1, 40)) for _ in range(60)]
    return docs, write(tmp_path / "a", docs)


def test_samples_are_windows_of_the_shuffled_documents(docs):
    docs, ds = docs
    samples = GPTSamples(ds, seq_len=16, seed=3)
    total = sum(len(d) for d in docs)
    assert samples.per_epoch == (total - 1) // 16
    docs_e0, ends, order = samples._epoch(0)
    stream = np.concatenate([docs[int(d)] for d in docs_e0])
    ids = np.concatenate([np.full(len(docs[int(d)]), i) for i, d in enumerate(docs_e0)])
    seen = set()
    for k in range(samples.per_epoch):
        tokens, doc_ids = samples[k]
        j = int(order[k])
        seen.add(j)
        assert np.array_equal(tokens, stream[j * 16:j * 16 + 17])
        assert np.array_equal(doc_ids, ids[j * 16:j * 16 + 17] - ids[j * 16])
    assert seen == set(range(samples.per_epoch))  # each sample once per epoch
    again = GPTSamples(ds, seq_len=16, seed=3)  # from the cache
    assert all(np.array_equal(again[k][0], samples[k][0]) for k in range(0, 200, 7))
    assert not np.array_equal(samples._epoch(1)[0], docs_e0)  # a new order each epoch


def test_split_by_documents():
    assert split_documents(1000, "969,30,1") == [range(0, 969), range(969, 999),
                                                  range(999, 1000)]
    assert split_documents(10, None) == [range(10), range(0), range(0)]
    with pytest.raises(DataError, match="expected numbers"):
        split_documents(10, "a,b")


def test_blend_draws_in_proportion(tmp_path):
    a = [("a", 0)] * 1
    src = [[(name, i) for i in range(100000)] for name in "abc"]
    blend = Blend(src, [0.5, 0.3, 0.2])
    drawn = [blend[k][0] for k in range(10000)]
    for name, w in zip("abc", (0.5, 0.3, 0.2), strict=True):
        assert abs(drawn.count(name) / 10000 - w) < 0.01
    assert blend.counts(10000) == [drawn.count(n) for n in "abc"]
    assert [blend[k][1] for k in range(30) if blend[k][0] == "b"] == list(range(9))
    assert a and parse_blend(["0.7", "A", "0.3", "B"]) == [(0.7, "A"), (0.3, "B")]
    for bad, msg in ((["A", "0.3"], "is not a weight"), (["0", "A"], "must be positive"),
                     (["0.7", "A", "B"], "WEIGHT PREFIX pairs")):
        with pytest.raises(DataError, match=msg):
            parse_blend(bad)


def test_the_same_samples_at_any_layout(docs):
    _, ds = docs
    batches = Batches(GPTSamples(ds, 8, 0), global_batch=8)
    whole = batches.local(16, dp=1, dp_rank=0, micro=8)[0].ids
    halves = [mb.ids for r in (0, 1) for mb in batches.local(16, dp=2, dp_rank=r, micro=2)]
    assert np.array_equal(np.concatenate(halves), whole)


BASE = ["train", "llama-debug", "--set", "vocab_size=257", "--seq-len", "16",
        "--lr", "1e-3", "--device", "cpu", "--json"]


@pytest.mark.slow
def test_resume_after_a_change_of_global_batch(tmp_path, docs, capsys):
    _, ds = docs
    run = tmp_path / "run"
    assert main([*BASE, "--data", ds.prefix, "--steps", "4", "--global-batch-size", "4",
                 "--exit-at-step", "2", "--save", str(run)]) == 0
    state = json.loads((run / "step-00000002" / "train_state.json").read_text())
    assert state["consumed_samples"] == 8
    assert main(["train", str(run), "--global-batch-size", "8", "--json"]) == 0
    state = json.loads((run / "step-00000004" / "train_state.json").read_text())
    assert state["consumed_samples"] == 8 + 2 * 8  # the next unseen samples, then on


def test_validation_loss_is_logged(tmp_path, docs):
    _, ds = docs
    assert main([*BASE, "--data", ds.prefix, "--split", "90,10,0", "--steps", "4",
                 "--eval-every", "2", "--eval-iters", "1", "--log-dir", str(tmp_path)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert all(np.isfinite(r["val_loss"]) for r in rows if "val_loss" in r)


def test_bad_data_is_a_one_line_error(tmp_path, docs, capsys):
    _, ds = docs
    big = write(tmp_path / "big", [np.array([1, 2, 300, 4] * 8)])
    cases = [([*BASE, "--data", big.prefix, "--steps", "1", "--global-batch-size", "1"],
              "beyond the model's vocabulary"),
             ([*BASE, "--data", str(tmp_path / "missing"), "--steps", "1"], "missing"),
             ([*BASE, "--data", "0.5", ds.prefix, "-1", ds.prefix, "--steps", "1"],
              "must be positive"),
             ([*BASE, "--data", ds.prefix, "0.5", "--steps", "1"], "WEIGHT PREFIX pairs"),
             ([*BASE, "--data", ds.prefix, "--steps", "1", "--eval-every", "1"],
              "needs validation data")]
    for argv, msg in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err


PEAK = """
import sys
from composer.cli import main
code = main(["train", "llama-debug", "--set", "vocab_size=257", "--seq-len", "64", "--steps",
             "2", "--global-batch-size", "4", "--device", "cpu", "--json", "--data", sys.argv[1]])
peak = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
print(int(peak.split()[1]) * 1024)
"""


@pytest.mark.slow
def test_memory_does_not_grow_with_the_corpus(tmp_path):
    rng = np.random.default_rng(0)
    peaks = []
    for name, n_docs in (("small", 2_000), ("large", 20_000)):  # 2M and 20M tokens
        with IndexedWriter(tmp_path / name, np.uint16) as w:
            for _ in range(n_docs):
                w.add_document(rng.integers(0, 250, 1000, dtype=np.uint16))
        out = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / name)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks.append(int(out.stdout.strip().splitlines()[-1]))
    assert peaks[1] - peaks[0] < 50 * 2**20, peaks
