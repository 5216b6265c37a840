"""The README's complete example, run as the user would (``python minimal.py``). The option
tables against the code: ``tests/unit/test_docs.py``."""

from __future__ import annotations

from pathlib import Path

from helpers import ROOT


def test_readme_minimal_example_runs(tmp_path: Path) -> None:
    """The README's complete example, run as the user would: ``python minimal.py``."""
    import os
    import subprocess
    import sys

    readme = (ROOT / "README.md").read_text()
    code = readme.split("## Use", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "minimal.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_epochs=2` reached." in proc.stdout + proc.stderr
