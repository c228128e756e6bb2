"""The tests' shared helpers (not part of the installed package): random weights that expose a
wrong mapping, exact tensor comparisons, the fp32 parity bound, and the small training loops that
layout-parity tests compare. Spawned ranks import it by name (``tests.helpers``; the repository
root is on ``sys.path`` through pytest's ``pythonpath``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    """Random weights (not default init) so that a swapped or dropped tensor shows in logits;
    norm-like vectors are centred on 1, buffers (e.g. score-correction biases) get noise too;
    constants held as buffers (RoPE frequencies, Gemma's embedding scale) are kept."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            centre = 1.0 if (p.ndim == 1 and ("norm" in name or name.endswith(".D"))) else 0.0
            p.copy_((noise + centre).to(p.dtype))


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    x, y = read_all(a), read_all(b)
    assert sorted(x) == sorted(y), (sorted(set(x) ^ set(y)))[:10]
    for k in x:
        assert x[k].dtype == y[k].dtype, (k, x[k].dtype, y[k].dtype)
        assert x[k].shape == y[k].shape, k
        assert torch.equal(x[k].view(torch.uint8) if x[k].dtype != torch.bool else x[k],
                           y[k].view(torch.uint8) if y[k].dtype != torch.bool else y[k]), k


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``, computed in fp64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def load_hf(folder: Path) -> torch.nn.Module:
    """transformers' ``AutoModelForCausalLM`` from ``folder`` (eval mode), every parameter and
    buffer copied into fresh memory. transformers may keep tensors as views of the memory-mapped
    file, whose addresses depend on the file's layout; BLAS kernels pick code paths by alignment,
    so the same weights at other addresses give other fp32 rounding. Fresh tensors have the
    allocator's alignment, so equal weights give equal bits whatever the file's layout."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None:
                    p.data = p.data.clone()
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.clone()
    return model


def hf_to_ours(hf_model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """Save a transformers model to ``folder/hf``, convert it to ``folder/ours`` and load that
    (the composer model)."""
    import composer
    from composer.convert import from_hf

    hf_model.save_pretrained(folder / "hf")
    from_hf(folder / "hf", folder / "ours")
    return composer.load(folder / "ours")


def assert_greedy_equals_hf(hf_model: torch.nn.Module, ours: torch.nn.Module, vocab: int,
                            new: int, prompts: tuple[int, ...] = (3, 9),
                            left_pad: int | None = None) -> None:
    """``composer.generate`` gives ``transformers.generate``'s greedy tokens: ``new`` tokens
    after batches of two prompts of each length in ``prompts`` (no end-of-sequence token), and,
    with ``left_pad``, after the last batch with its second row's first ``left_pad`` tokens
    masked out."""
    import composer

    hf_model.generation_config.eos_token_id = None

    def hf_greedy(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return hf_model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                     do_sample=False, pad_token_id=0)

    for t in prompts:
        ids = torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(t))
        got, want = composer.generate(ours, ids, new), hf_greedy(ids, torch.ones_like(ids))
        assert torch.equal(got, want), (t, got[:, t:], want[:, t:])
    if left_pad is not None:
        mask = torch.ones_like(ids)
        mask[1, :left_pad] = 0
        got = composer.generate(ours, ids, new, attention_mask=mask)
        assert torch.equal(got, hf_greedy(ids, mask)), (got, hf_greedy(ids, mask))


FP32_PARITY = 1e-4
"""Bound on :func:`rel_err` between two fp32 implementations of the same model (ours and
transformers', or a converted checkpoint's logits) on the tiny random configs of the tests.

Error model: each side rounds every operation in fp32 (unit roundoff u = 2**-24 = 6.0e-8);
a length-k reduction carries a relative error of at most k u (worst case) and about sqrt(k) u
(rounding errors of random sign); the two sides differ only in the order of operations (BLAS
blocking, fused or split projections, chunked or sequential scans), so their difference is the
sum of two such errors. A logit goes through ~4 reductions per layer (norm, projection, mixer,
output) of length k <= 128 over L <= 8 layers, about sqrt(2 * 4 * L * k) u = 2e-6 of the
logits' scale; a chunked scan's triangular solve (the delta rule, SSD) multiplies its share by
the solve's condition number, O(10) for chunks <= 64 with beta <= 2. So ~2e-6 (attention,
Mamba, MoE) to ~2e-5 (gated delta nets) is expected, as measured on the tests here (at most
9e-6 without, 2.4e-5 with gated delta nets, over three seeds of one config ~1.2e-5 of our own
fp32 against fp64). 1e-4 leaves 4x over the worst measured and 10x over the rest, while one
wrong weight moves the logits by O(1e-1); nothing in it depends on which BLAS kernel runs.
Outside the model: a top-k router choice between two scores closer than the noise is a jump
(one seed of a 4-expert top-2 config moved 2.5e-4 between our fp32 and fp64). The top-k tests'
seeds have no such tie (they pass under MKL's AVX and COMPATIBLE kernels too); a new parity test
routes to every expert (top-k of k) or picks a seed whose margins exceed the noise."""


@contextlib.contextmanager
def fp64_masters() -> Iterator[None]:
    """The engine builds its master weights in fp64 instead of fp32 (this process only).

    Engine parity tests compare layouts in fp64: in fp32 a change of summation order (another
    layout, another BLAS kernel, another thread count) moves near-zero gradients by rounding
    noise, which AdamW's normalisation turns into parameter differences of up to ``lr`` per step,
    so no fp32 tolerance both holds on every CPU and catches a wrong factor."""
    import composer.run

    build = composer.run.build_sharded

    def fp64(*args, **kwargs):
        return build(*args, **{**kwargs, "dtype": torch.float64})

    composer.run.build_sharded = fp64
    try:
        yield
    finally:
        composer.run.build_sharded = build


def train_case(values: dict, source: str | None = None, fp64: bool = False) -> dict:
    """Run ``composer train`` with recipe ``values`` in this process (every rank calls it) and
    return its per-step ``losses``, logged ``rows``, final ``params`` and ``buffers`` (whole
    tensors, by name), and ``local_numel`` (the parameter entries this rank holds): what tests
    of the engine compare between layouts. ``fp64``: masters in
    fp64 (:func:`fp64_masters`)."""
    from composer.train.engine import resolve, setup
    from composer.train.loop import train_loop

    with fp64_masters() if fp64 else contextlib.nullcontext():
        recipe, resume = resolve(source, None, values)
        run, last = setup(recipe, resume, quiet=True)
        try:
            summary = train_loop(run, last, quiet=True)
        finally:
            run.log.close()
    def whole(v: torch.Tensor) -> torch.Tensor:
        return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()

    def local(v: torch.Tensor) -> torch.Tensor:
        return v.to_local() if hasattr(v, "to_local") else v

    return {"losses": summary.losses, "rows": summary.rows, "step": summary.step,
            "local_numel": sum(local(v).numel() for v in run.model.parameters()),
            "params": {k: whole(v) for k, v in run.model.named_parameters()},
            "buffers": {k: whole(v) for k, v in run.model.named_buffers()}}


@dataclass
class TrainResult:
    losses: list[float]
    step: int


def _backward(model: torch.nn.Module, dims, ids: torch.Tensor, global_rows: int) -> torch.Tensor:
    """Backward of the mean loss of a global batch (``ids`` this rank's rows); returns this
    rank's mean loss. Through the pipeline when the model has one (``pp`` micro-batches)."""
    from composer.parallel.data import finish_grads

    pipeline = getattr(model, "pipeline", None)
    if pipeline is None:
        out = model(ids, ids)
        out.loss.backward()
        finish_grads(model, dims)
        return out.loss
    if pipeline.n_micro is None:
        pipeline.configure("interleaved-1f1b" if len(pipeline.groups) > dims.pp else "1f1b",
                           dims.pp)
    n_global = global_rows * (ids.shape[1] - 1)
    ce, aux, mtp = pipeline.train_step(ids, None, dims.grad_replicas / n_global)
    finish_grads(model, dims)
    pipeline.sync_tied()
    pipeline.sync_shared()
    total = torch.stack([ce, aux + mtp]).to(torch.float64)
    torch.distributed.all_reduce(total, group=dims.pp_mesh.get_group())
    return total[0] / (ids.shape[0] * (ids.shape[1] - 1)) + total[1]


def adamw_steps(model: torch.nn.Module, dims, opt: torch.optim.Optimizer,
                rows: list[np.ndarray], steps: int, batch_size: int, seed: int,
                start_step: int = 0, on_step=None) -> TrainResult:
    """Plain AdamW steps at a constant learning rate on a layout-independent sequence of global
    batches (no accumulation, clipping or schedule): the minimal loop that layout-parity tests
    of the parallel code run in any dtype. ``composer.train`` is the training engine."""
    from composer.run import _dp_sum

    assert len({len(r) for r in rows}) == 1 and batch_size % dims.dp == 0
    data = np.stack(rows)
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(data)) for _ in
                            range(math.ceil((start_step + steps) * batch_size / len(data)) + 1)])
    share = batch_size // dims.dp
    model.train()
    losses = []
    for step in range(start_step, start_step + steps):
        batch = order[step * batch_size:(step + 1) * batch_size]
        local = batch[dims.dp_rank() * share:(dims.dp_rank() + 1) * share]
        ids = torch.from_numpy(data[local]).long().to(dims.device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = _backward(model, dims, ids, batch_size)
        opt.step()
        loss = _dp_sum(loss.detach().double().reshape(1), dims) / dims.dp
        losses.append(float(loss))
        if on_step is not None:
            on_step(step + 1, losses[-1])
    return TrainResult(losses=losses, step=start_step + steps)


def layout_case(layout: dict, cfg_dict: dict, data: np.ndarray, fp64: bool = False,
                lr: float = 1e-4, steps: int = 3, doc_ids: np.ndarray | None = None) -> dict:
    """What a parallel layout computes, for layout-parity tests (every rank runs it; ``{}`` is
    one process): the eval loss, the gradients of one global batch (gathered whole) and the
    weights after ``steps`` plain AdamW steps, for a model built shard-local with seed 7.
    ``doc_ids`` (one row per data row): also the eval loss of the rows as packed documents
    (``eval_packed``)."""
    from composer.config import ModelConfig
    from composer.parallel.mesh import ParallelConfig, build_parallel_dims
    from composer.run import build_sharded, evaluate

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    cfg = ModelConfig.from_dict(cfg_dict)
    dims = build_parallel_dims(ParallelConfig(**layout))
    model = build_sharded(cfg, dims, seed=7, dtype=torch.float64 if fp64 else None)
    rows = list(data)
    loss, _ = evaluate(model, dims, rows, batch_size=2)
    packed = None if doc_ids is None else evaluate(model, dims, rows, 2, list(doc_ids))[0]
    share = len(rows) // dims.dp
    mine = torch.from_numpy(data[dims.dp_rank() * share:(dims.dp_rank() + 1) * share]).long()
    model.train()
    _backward(model, dims, mine, len(rows))
    grads = {k: whole(p.grad).clone() for k, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    result = adamw_steps(model, dims, opt, rows, steps, batch_size=4, seed=3)
    params = {k: whole(p.detach()).clone() for k, p in model.named_parameters()}
    return {"eval": loss, "grads": grads, "losses": result.losses, "params": params,
            "eval_packed": packed}


VL_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|image_pad|>"]
VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen-VL's way of writing an image in a message: one placeholder between the markers."""


def write_vl_tokenizer(folder: Path, corpus: list[str], specials: list[str] = VL_SPECIALS,
                       template: str = VL_TEMPLATE, vocab_size: int = 300,
                       preprocessor: dict | None = None) -> Path:
    """A tiny byte-level BPE trained on ``corpus`` with Qwen-VL's chat and vision special
    tokens and chat template (``<|im_end|>`` its end of turn), loadable by HFTokenizer; with
    ``preprocessor``, a ``preprocessor_config.json`` of those settings beside it."""
    import json

    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
         "chat_template": template}))
    if preprocessor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return folder


def adamw_losses(model: torch.nn.Module, ids: torch.Tensor, steps: int,
                 lr: float = 3e-3) -> list[float]:
    """The loss of each of ``steps`` AdamW steps of ``model`` on the fixed rows ``ids`` (its
    own labels): the "a tiny model learns" check of the block tests."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = model(ids, ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses


def only_kernels(monkeypatch, *names: str) -> None:
    """Let a test's fake-GPU dispatch (``probe.on_gpu`` patched true) reach only the kernels
    ``names`` (the ones it fakes): every other optional kernel is switched off by
    ``COMPOSER_DISABLE_KERNELS``, so a real package installed beside the tests (CI installs
    mamba-ssm, fla and triton for tests/kernels/wiring) is never called on CPU tensors."""
    from composer.kernels import probe

    monkeypatch.setenv(probe.ENV_DISABLE, ",".join(sorted(set(probe.KERNELS) - set(names))))
    probe.reset()



# ------------------------------------------------------- counting a step's collectives

COLLECTIVE_OPS = {
    # c10d op (torch.distributed's calls) or functional op -> (collective, index of the
    # argument that is the buffer; None: the op's output)
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0), "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0), "all_reduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", None),
    "all_gather_into_tensor_coalesced": ("all_gather", None),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0),
    "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0),
}
NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


@dataclass
class Call:
    op: str
    ranks: tuple[int, ...]
    nbytes: int
    out: torch.Tensor | None = None
    """An int64 all-to-all's output (the routing counts a rank receives), else None; read it
    after the step."""


class CollectiveCounter(TorchDispatchMode):
    """Every collective issued inside it, whoever issues it: torch.distributed's calls (FSDP2,
    pipelining's sends and receives, composer's own) reach the dispatcher as ``c10d`` ops, and
    DTensor's and the autograd all-to-alls as ``_c10d_functional`` ops; both pass through a
    dispatch mode. Each call's collective, its group's global ranks and its buffer's bytes (the
    convention of :mod:`composer.plan.comm`). Calls over one rank (which move nothing) and
    barriers are left out; an op it does not know raises."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    @staticmethod
    def _ranks(args: tuple) -> tuple[int, ...]:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        for a in args:
            if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
        name = args[-1]  # a functional collective's last argument is its group's name
        return tuple(dist.get_process_group_ranks(_resolve_process_group(name)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace not in ("c10d", "_c10d_functional"):
            return out
        name = func._opname
        if name in NOT_COLLECTIVES or "barrier" in name:
            return out
        op, at = COLLECTIVE_OPS[name]  # an unknown collective: a KeyError naming it
        ranks = self._ranks(args)
        if len(ranks) > 1:
            buffer = out if at is None else args[at]
            tensors = list(_tensors(buffer))
            counts = None
            if op == "all_to_all" and tensors[0].dtype == torch.int64:  # what it receives
                # held, not copied: an asynchronous call fills it only once it is waited on
                counts = out if name == "all_to_all_single" else args[0]
            self.calls.append(Call(op, ranks, sum(t.numel() * t.element_size()
                                                  for t in tensors), counts))
        return out

    def totals(self) -> dict[tuple[str, tuple[int, ...]], int]:
        """Bytes by (collective, group ranks)."""
        out: dict[tuple[str, tuple[int, ...]], int] = {}
        for c in self.calls:
            out[(c.op, c.ranks)] = out.get((c.op, c.ranks), 0) + c.nbytes
        return out


def _tensors(x) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
