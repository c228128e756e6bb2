"""Data path speed: `composer data prepare` throughput and the loader's share of a training step.

    python bench/data.py [--repeat 3] [--steps 20] [--scale 10]

1. prepare: the built-in corpus's text (Tiny Shakespeare, 1.1 MB, as 7,222 jsonl documents),
   repeated ``--scale`` times (default 10: 11 MB, so that the workers' start-up, ~1 s each for
   importing torch, is not the whole measurement), with the byte tokenizer and with a
   byte-level BPE tokenizer trained here for the benchmark (``tokenizers``, 4,096 tokens), 1
   and 2 workers: MB/s of text and tokens/s (best of ``--repeat``).
2. loader: training steps of the `shakespeare` recipe's model and of a ~50M hybrid
   (``M*-M*-``, d_model 512) on the built-in corpus, timing the loader's work (reading this
   rank's samples of the global batch: ``Batches.local``) against the whole step. Goal: under
   2% of the step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from composer.data.corpus import BUILTIN, speeches
from composer.data.indexed import IndexedDataset
from composer.data.prepare import prepare

SOURCE = Path("/tmp/tinyshakespeare.txt")


def corpus_text() -> list[str]:
    """The corpus's documents, decoded back from the shipped dataset (byte tokens)."""
    ds = IndexedDataset(BUILTIN)
    return [bytes(ds.document(d)[:-1].astype("uint8")).decode("utf-8", "replace")
            for d in range(ds.n_documents)]


def bpe_tokenizer(docs: list[str], folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(docs, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def bench_prepare(repeat: int, scale: int) -> list[dict]:
    docs = (speeches(SOURCE.read_text()) if SOURCE.exists() else corpus_text()) * scale
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "docs.jsonl"
        jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        bpe = bpe_tokenizer(docs, Path(tmp) / "bpe")
        for name, tok in (("byte", "byte"), ("bpe-4096", str(bpe))):
            for workers in (1, 2):
                best = None
                for i in range(repeat):
                    stats = prepare([str(jsonl)], f"{tmp}/out-{name}-{workers}-{i}", tok,
                                    append_eod=True, workers=workers)
                    if best is None or stats["seconds"] < best["seconds"]:
                        best = stats
                rows.append({"tokenizer": name, "workers": workers, "mb_per_s": best["mb_per_s"],
                             "tokens_per_s": best["tokens_per_s"], "n_tokens": best["n_tokens"],
                             "seconds": best["seconds"]})
    return rows


def bench_loader(steps: int) -> list[dict]:
    from composer.train import loop
    from composer.train.engine import resolve, setup

    models = {"shakespeare": {"config": "shakespeare"},
              "hybrid-50M": {"model": {"pattern": "M*-M*-", "set": {
                  "vocab_size": 257, "d_model": 512, "attention.n_heads": 8,
                  "mamba.n_heads": 16, "mamba.d_head": 64, "mlp.d_ff": 2048}},
                  "seq_len": 512, "global_batch_size": 8, "lr": 1e-3}}
    rows = []
    for name, values in models.items():
        config = values.pop("config", None)
        recipe, resume = resolve(None, config, {**values, "steps": steps + 2, "device": "cpu",
                                                "precision": "fp32", "eval_every": 0})
        run, _ = setup(recipe, resume, quiet=True)
        loader_s = 0.0
        real = run.batches.local

        def timed(*args, real=real, **kwargs):
            nonlocal loader_s
            t = time.perf_counter()
            out = real(*args, **kwargs)
            loader_s += time.perf_counter() - t
            return out

        run.batches.local = timed
        for step in (1, 2):  # warm up
            loop.take_step(run, step, False)
        loader_s = 0.0
        start = time.perf_counter()
        for step in range(3, steps + 3):
            loop.take_step(run, step, False)
        total = time.perf_counter() - start
        run.log.close()
        rows.append({"model": name, "step_s": total / steps, "loader_s": loader_s / steps,
                     "loader_share": loader_s / total,
                     "tokens_per_step": recipe.global_batch_size * (recipe.seq_len + 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--scale", type=int, default=10, help="copies of the corpus to prepare")
    args = ap.parse_args()
    print("| tokenizer | workers | MB/s of text | tokens/s | tokens |")
    print("|---|---|---|---|---|")
    for r in bench_prepare(args.repeat, args.scale):
        print(f"| {r['tokenizer']} | {r['workers']} | {r['mb_per_s']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {r['n_tokens']:,} |")
    print()
    print("| model | step (s) | loader (ms) | loader share | tokens/step |")
    print("|---|---|---|---|---|")
    for r in bench_loader(args.steps):
        print(f"| {r['model']} | {r['step_s']:.3f} | {r['loader_s'] * 1e3:.2f} | "
              f"{r['loader_share']:.2%} | {r['tokens_per_step']:,} |")


if __name__ == "__main__":
    main()
