"""Calibration and counterfactual tokens on SYNTHETIC censored rows with a known acceptance curve."""

import numpy as np

from vcap.sidecar.controller.calibration import AcceptanceCalibration, isotonic, observed_drafts
from vcap.sidecar.controller.goodput import accepted_table

NUM_DRAFTS = 5


def _true_accept(confidence):
    # SYNTHETIC known curve: position i accepts with 0.1 + 0.8 * c ** (1 + i / 4)
    exponent = 1 + np.arange(NUM_DRAFTS) / 4
    return 0.1 + 0.8 * confidence ** exponent


def _synthetic_rows(rng, rows=200_000, explore_fraction=0.1):
    confidence = rng.random((rows, NUM_DRAFTS)).astype(np.float32)
    success = rng.random((rows, NUM_DRAFTS)) < _true_accept(confidence)
    uncapped = np.cumprod(success, axis=1).sum(axis=1)
    # a confidence policy caps most rows (threshold 0.3 on the running product), some explore
    running = np.cumprod(confidence, axis=1)
    live = np.clip((np.cumprod(running >= 0.3, axis=1)).sum(axis=1), 1, NUM_DRAFTS) + 1
    live[rng.random(rows) < explore_fraction] = NUM_DRAFTS + 1
    return confidence, live, np.minimum(uncapped, live - 1), uncapped


def test_isotonic_is_monotone_and_pools_violators():
    fitted = isotonic(np.array([0.1, 0.5, 0.3, 0.7]), np.array([1, 1, 1, 1]))
    np.testing.assert_allclose(fitted, [0.1, 0.4, 0.4, 0.7])


def test_censored_drafts_are_not_rejections():
    observed, accepted = observed_drafts(np.array([3, 3, 6]), np.array([2, 1, 0]), NUM_DRAFTS)
    # L=3, accepted 2: drafts 1,2 accepted, 3..5 unobserved (capped)
    assert observed[0].tolist() == [True, True, False, False, False]
    assert observed[1].tolist() == [True, True, False, False, False]
    assert accepted[1].tolist() == [True, False, False, False, False]
    assert observed[2].tolist() == [True, False, False, False, False]


def test_calibration_recovers_known_curve_within_0_04():
    rng = np.random.default_rng(1)
    confidence, live, accepted, _ = _synthetic_rows(rng)
    calibration = AcceptanceCalibration(NUM_DRAFTS, num_bins=20, half_life_rows=float("inf"))
    calibration.update(confidence, live, accepted)
    centres = (np.arange(20) + 0.5) / 20
    truth = _true_accept(np.repeat(centres[:, None], NUM_DRAFTS, axis=1)).T
    enough = calibration.trials >= 400
    assert (enough.sum(axis=1)[:3] >= 5).all()  # early positions have many well-observed bins
    error = np.abs(calibration.table() - truth)[enough]
    assert error.max() < 0.04, error.max()


def test_counterfactual_tokens_match_the_uncapped_truth():
    rng = np.random.default_rng(2)
    confidence, live, accepted, uncapped = _synthetic_rows(rng, rows=100_000)
    calibration = AcceptanceCalibration(NUM_DRAFTS, half_life_rows=float("inf"))
    calibration.update(confidence, live, accepted)
    table = accepted_table(confidence, live, accepted, calibration)
    for target in range(2, NUM_DRAFTS + 2):
        truth = np.minimum(uncapped, target - 1).mean()
        assert abs(table[:, target].mean() - truth) < 0.02 * max(truth, 0.1), target
    # exact where observed: a cut shorter than the recorded one
    shorter = live >= 3
    np.testing.assert_array_equal(table[shorter, 3], np.minimum(accepted[shorter], 2))
