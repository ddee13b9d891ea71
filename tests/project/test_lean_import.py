"""``import autoprec`` stays light: no optuna, matplotlib, transformers or torchao, and no CUDA initialised."""

import subprocess
import sys


def test_import_is_lean():
    code = ("import sys, torch, autoprec; "
            "heavy = [m for m in ('optuna', 'matplotlib', 'transformers', 'sklearn', 'torchao') if m in sys.modules]; "
            "print(heavy, torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] False"
