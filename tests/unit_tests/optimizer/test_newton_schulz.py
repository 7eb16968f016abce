"""Newton-Schulz against float64 references: the exact iteration and how orthogonal its result is (CPU).

Tolerances: float32 against float64 of the same iteration, 1e-5 relative (five matmul
rounds of O(1) values); the bfloat16 iteration (--muon-fp32-matmul-prec medium) 2e-2
(bfloat16 keeps 8 bits).
"""

import pytest
import torch

from megatron.core.optimizer.newton_schulz import (
    COEFFICIENT_SETS,
    check_coefficients,
    coefficients,
    newton_schulz,
    scale_factor,
)


def reference(x: torch.Tensor, schedule) -> torch.Tensor:
    """The iteration written out in float64: normalize, iterate on the wide side, ``a X + b (XX^T) X + c (XX^T)^2 X``."""
    x = x.double()
    wide = x.size(-2) > x.size(-1)
    if wide:
        x = x.mT
    x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp_min(1e-15)
    for a, b, c in schedule:
        gram = x @ x.mT
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.mT if wide else x


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 8)])
@pytest.mark.parametrize("kind", ["quintic", "simple", "polar_express", "aol", "cubic5"])
def test_iteration_matches_float64(shape, kind):
    torch.manual_seed(0)
    x = torch.randn(shape)
    schedule = list(coefficients(kind, 5))
    got = newton_schulz(x, 5, kind)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert rel(got, reference(x, schedule)) < 1e-5


def test_schedules_cycle_or_repeat_the_last_set():
    quintic = COEFFICIENT_SETS["quintic"]
    assert list(coefficients("quintic", 7)) == list(quintic) + list(quintic[:2])
    polar = COEFFICIENT_SETS["polar_express"]
    assert list(coefficients("polar_express", 10)) == list(polar) + [polar[-1]] * 2
    torch.manual_seed(1)
    x = torch.randn(16, 32)
    assert (
        rel(newton_schulz(x, 9, "aol"), reference(x, list(COEFFICIENT_SETS["aol"]) * 2 + [COEFFICIENT_SETS["aol"][0]]))
        < 1e-5
    )


def test_bfloat16_iteration_follows_the_float64_one():
    torch.manual_seed(2)
    x = torch.randn(32, 64)
    got = newton_schulz(x, 5, "quintic", bf16=True)
    assert got.dtype == torch.float32
    err = rel(got, reference(x, coefficients("quintic", 5)))
    assert 0 < err < 2e-2  # it did run in bfloat16, and close to the float64 iteration


def test_result_is_nearly_orthogonal():
    torch.manual_seed(3)
    x = torch.randn(48, 96, dtype=torch.float64).float()
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    polar = u @ vh
    # Quintic: singular values pushed into a band around 1 (Megatron's trade of exactness for steps).
    sv = torch.linalg.svdvals(newton_schulz(x, 5, "quintic").double())
    assert sv.min() > 0.6 and sv.max() < 1.25
    # Polar Express converges: many steps give U V^T.
    got = newton_schulz(x, 12, "polar_express")
    assert (got.double() - polar).abs().max() < 1e-3
    assert rel(got @ got.mT, torch.eye(48)) < 1e-3


def test_zero_input_stays_zero():
    assert torch.equal(newton_schulz(torch.zeros(8, 4), 5), torch.zeros(8, 4))


def test_scale_modes():
    assert scale_factor(64, 16, "spectral") == 8.0
    assert scale_factor(16, 64, "unit_rms_norm") == 0.5
    assert scale_factor(16, 64, "shape_scaling") == 1.0
    assert scale_factor(64, 16, "shape_scaling") == 2.0


def test_bad_settings_name_the_flag():
    with pytest.raises(ValueError, match="--muon-coefficient-type"):
        check_coefficients("cubic", 5)
    with pytest.raises(ValueError, match="--muon-num-ns-steps 5"):
        check_coefficients("cubic5", 6)
    with pytest.raises(ValueError, match="--muon-num-ns-steps"):
        check_coefficients("quintic", 0)
    with pytest.raises(ValueError, match="float32"):
        newton_schulz(torch.zeros(4, 4, dtype=torch.float64), 5)
