"""The core never imports the adapters: protocol and privacy work without Flower and Ray."""

import subprocess
import sys


def test_core_imports_without_flower_and_ray():
    code = (
        "import sys\n"
        "sys.modules['flwr'] = None; sys.modules['ray'] = None\n"  # any import of them now fails
        "import numpy as np\n"
        "import flwr_inca, flwr_inca.protocol, flwr_inca.privacy, flwr_inca.cli, flwr_inca.simulation\n"
        "import flwr_inca.baselines, flwr_inca.reproduce\n"
        "r = flwr_inca.run_inca(np.ones((4, 2)), flwr_inca.IncaConfig(sigma_star=0.0, sigma_delta=1.0), seed=0)\n"
        "assert np.allclose(r.estimate, 1.0)\n"
        "assert 'flwr' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
