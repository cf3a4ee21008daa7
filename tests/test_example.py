"""The main job: examples/mnist.py trains the template CNN on the bundled digits to >= 97%."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_example_reaches_its_accuracy_on_the_bundled_digits(tmp_path):
    env = dict(os.environ, XLA_FLAGS="")  # one CPU device, as a user's laptop
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", "mnist.py"), "--check",
                          "--workdir", str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    accuracy = float(re.search(r"final test accuracy: ([\d.]+)", out.stdout).group(1))
    assert accuracy >= 0.97, out.stdout
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "logs"]  # in the workdir, nowhere else
