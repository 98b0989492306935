"""The checkout's kernels/ directory never shadows an installed top-level `kernels` distribution
(Hugging Face's, which transformers imports) when Python runs from the repository root."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_kernels(extra_path: str) -> str:
    code = "import kernels; print(getattr(kernels, 'CUDAProperties', 'ours'))"
    env_path = f"{ROOT}:{extra_path}" if extra_path else str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    return out.stdout.strip()


def test_an_installed_kernels_distribution_wins_over_the_checkout(tmp_path):
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("CUDAProperties = 'installed'\n")
    assert _import_kernels(str(tmp_path / "site")) == "installed"
    import rlengine.kernels.fused_norm  # noqa: F401  the package's own name is unaffected
