"""``compile_layers``: same keys, same loss and gradients as eager.

Uses the ``aot_eager`` backend (dynamo capture + AOT autograd, the part that can change results,
without inductor's C++ build, which takes minutes on a 2-core CI machine)."""

import pytest
import torch

from composer import build_model
from composer.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig, MoEConfig
from composer.kernels import compile_layers


def _model() -> torch.nn.Module:
    cfg = ModelConfig(pattern="M*-E", d_model=32, vocab_size=97,
                      attention=AttentionConfig(n_heads=4, n_kv_heads=2),
                      mamba=MambaConfig(n_heads=4, d_head=16, n_groups=2, d_state=8, chunk_size=8),
                      mlp=MLPConfig(d_ff=64), moe=MoEConfig(n_experts=4, top_k=2, d_ff=32))
    return build_model(cfg, seed=3)


@pytest.mark.slow
def test_compiled_layers_match_eager() -> None:
    torch._dynamo.reset()
    eager, compiled = _model(), _model()
    compile_layers(compiled, backend="aot_eager")
    assert list(compiled.state_dict()) == list(eager.state_dict())
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(4))
    want, got = eager(ids, ids), compiled(ids, ids)
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=0)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_compile_layers_needs_a_hybrid_model() -> None:
    with pytest.raises(TypeError, match="HybridModel"):
        compile_layers(torch.nn.Linear(2, 2))
