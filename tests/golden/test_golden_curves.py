"""Fixed-seed tiny runs reproduce their stored loss curves (``tests/golden/*.json``).

Tolerance: 1e-5 relative per iteration. The same curves computed with PyTorch forced onto its AVX2 code
(``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``) differ from the
AVX-512 ones by at most 9e-8 relative; a 1% larger ``--init-method-std`` moves the mock curve by 3.4e-4,
a 10% larger ``--min-lr`` by 2.5e-4, one more warmup iteration by 8.9e-3. A failure after an intended
change of initialization, data order, schedule or loss means: regenerate on purpose (command in
``tests/golden/__init__.py``) and commit the new files with the change.
"""

from __future__ import annotations

import pytest
import torch

from tests.golden.runs import RUNS, load_golden

RTOL = 1e-5


@pytest.mark.parametrize("name", list(RUNS))
def test_loss_curve_matches_the_stored_golden_curve(name: str) -> None:
    golden = load_golden(name)
    got = RUNS[name]()
    for key in ("losses", "validation_losses"):
        assert len(got[key]) == len(golden[key]), key
        torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                   torch.tensor(golden[key], dtype=torch.float64), rtol=RTOL, atol=0.0,
                                   msg=lambda m, key=key: f"{name} {key} moved from the golden curve ({m}); if "
                                   f"intended, regenerate: {golden['regenerate']}")
    assert len(golden["losses"]) == 8 and golden["losses"][-1] < golden["losses"][0], "the golden run learns"
