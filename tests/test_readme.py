"""Every Python example of the README runs as written, each in a fresh interpreter that has
imported nothing: ``>>>`` blocks as doctests (output compared, ``...`` matches anything), plain
blocks executed in a scratch folder."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2 and any(b.lstrip().startswith(">>>") for b in BLOCKS)


DRIVER = """
import doctest, re, sys
block = re.findall(r"```python\\n(.*?)```", open(sys.argv[1]).read(), flags=re.S)[int(sys.argv[2])]
if block.lstrip().startswith(">>>"):
    test = doctest.DocTestParser().get_doctest(block, {}, f"README[{sys.argv[2]}]", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    sys.exit(0 if runner.failures == 0 and runner.tries > 0 else 1)
exec(compile(block, f"README[{sys.argv[2]}]", "exec"), {})
"""


# the doctests are quick; a plain block builds models in a fresh interpreter (seconds)
@pytest.mark.parametrize("index", [i if b.lstrip().startswith(">>>") else
                                   pytest.param(i, marks=pytest.mark.slow)
                                   for i, b in enumerate(BLOCKS)])
def test_readme_example_runs(index, tmp_path):
    # Each example in a fresh interpreter (in a scratch folder: examples may write files), as a
    # reader runs it: what it uses must be reachable from its own imports, not from modules
    # this test process imported for other tests (``composer.zoo`` after ``import composer``).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(README), str(index)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
