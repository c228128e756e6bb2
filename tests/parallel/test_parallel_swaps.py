"""The parallel forms leave the blocks alone (docs/parallelism.md): tensor, vocabulary and expert
parallelism put new modules in place of the ones they change, holding the same parameters,
instead of assigning ``__class__`` or writing state onto blocks. Checked on the model as
``parallelize`` leaves it (meta device), at tp=2 (with MTP and MoE) and ep=2 (dp=2, FSDP2)."""

import pytest

from composer.config import ModelConfig
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import ParallelConfig
from tests.parallel.test_mtp_parallel import mtp_cfg

FOREIGN_ATTRS = ("tp", "tp_rank", "rows", "ep", "_composer_local_views", "group", "grad_scale")


def swaps(layout: dict, cfg_dict: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from composer.build.builder import build_model
    from composer.parallel.mesh import build_parallel_dims
    from composer.parallel.parallelize import parallelize

    cfg = ModelConfig.from_dict(cfg_dict)
    model = build_model(cfg, device="meta")
    before = {name: (type(m), m) for name, m in model.named_modules()}
    own = {name: set(vars(m)) for name, m in model.named_modules()}  # what the blocks hold
    keys = list(model.state_dict())
    dims = build_parallel_dims(ParallelConfig(**layout))
    parallelize(model, dims)
    replaced, changed_class, written = [], [], []
    for name, module in model.named_modules():
        cls, old = before.get(name, (None, None))
        if old is not module:
            replaced.append(f"{name}:{type(module).__name__}")
        elif type(module) is not cls and not (isinstance(module, FSDPModule)
                                              and isinstance(module, cls)):
            changed_class.append(name)  # FSDP2's own class swap (ep2: dp=2) is torch's
        elif old is not None:
            written += [f"{name}.{a}" for a in FOREIGN_ATTRS
                        if a in vars(module) and a not in own[name]]
    tagged = [n for n, p in model.named_parameters() if hasattr(p, "_tp_grad")]
    kinds = sorted(dims.tp_context.grad_kinds) if dims.tp_context is not None else []
    dist.barrier()  # no collective ran: a rank leaving early breaks its peer's group set-up
    return {"keys": list(model.state_dict()) == keys, "replaced": sorted(replaced),
            "changed_class": changed_class, "written": written, "tagged": tagged,
            "kinds": kinds}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}], ids=["tp2", "ep2"])
def test_parallel_forms_replace_modules_and_keep_keys(layout: dict) -> None:
    got = run_distributed(swaps, 2, layout, mtp_cfg().to_dict())[0]
    assert got["keys"]  # same state-dict keys, same order
    assert got["changed_class"] == [] and got["written"] == [] and got["tagged"] == []
    names = {r.split(":")[1] for r in got["replaced"]}
    if "tp" in layout:
        assert {"RowParallelLinear", "VocabParallelEmbedding", "VocabParallelReadout",
                "SequenceChunkTP", "GlobalSum"} <= names, got["replaced"]
        assert "layers.0.norm.weight" in got["kinds"] and "mtp.1.proj.weight" in got["kinds"]
    else:
        assert names == {"ExpertParallelExperts", "GlobalSum"}, got["replaced"]
