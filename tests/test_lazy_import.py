"""``import composer`` is lazy (PEP 562): it imports no torch, and every public name, the
version and the subpackages (``composer.zoo``, ``composer.convert``) load on first use."""

import subprocess
import sys

import pytest

SCRIPT = """
import sys
import composer
assert 'torch' not in sys.modules, 'import composer imported torch'
assert set(composer.__all__) == set(composer._WHERE), 'the spelled-out __all__ drifted'
print(composer.zoo.get_preset('llama-debug').family)
print('torch' in sys.modules)
print(composer.convert.__name__, composer.ModelConfig.__module__, composer.__version__)
from composer import build_model, parse_pattern
assert all(getattr(composer, n) is not None for n in composer.__all__)
try:
    composer.no_such_thing
except AttributeError as exc:
    print(exc)
"""


@pytest.mark.slow
def test_import_composer_is_lazy(tmp_path):
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "llama", "False", f"composer.convert composer.config {version('composer-lm')}",
        "module 'composer' has no attribute 'no_such_thing'"]
