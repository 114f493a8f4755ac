"""The engine's start-up step-time profile: SGLang's DSpark SPS table, read as SGLang writes it.

A DSpark server is profiled before it serves (``python -m sglang.benchmark.dspark_sps_profiler``)
and loads the result with ``--speculative-dspark-sps-table-path``. The file is JSON in one of two
shapes (``sglang/srt/speculative/dspark_components/dspark_sps.py``, SGLang 0.5.23):

- ``SpsCostTable``: ``sample_batch_tokens`` (strictly increasing) and ``sample_steps_per_sec``,
  steps per second of a step that verifies that many tokens, and ``max_batch_tokens``;
- ``SpsAdditiveCostTable``: ``bias_seconds + alpha(num_reqs) + theta(num_reqs + budget)``, each
  term linearly interpolated between its probes and clamped beyond them.

The controller reads the same file (``--controller-sps-table``) for the shape of the step cost in
verify tokens, which its linear fit cannot have (a fused MoE pays rows per tile). The level comes
from the engine's own measured steps (:mod:`.measured`), so a profile taken at another context
length or routing still ranks live lengths correctly. Between the probes of an ``SpsCostTable``
the step time is interpolated linearly (SGLang's planner takes the probe below, which makes every
token up to the next probe free); beyond the probes it is held at the nearest one.

Read with the standard library: the sidecar does not depend on SGLang or msgspec.
"""

import json
import math
from dataclasses import dataclass

import numpy as np

from ..files import read_regular

__all__ = ["StepProfile", "load_step_profile"]


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Seconds per step as a function of requests and verify tokens (``seconds(bs, tokens)``)."""

    bias_s: float
    bs_probes: np.ndarray       # alpha(num_reqs), seconds
    alpha_s: np.ndarray
    token_probes: np.ndarray    # theta(verify tokens), seconds
    theta_s: np.ndarray
    source: str = ""

    def seconds(self, bs, tokens) -> np.ndarray:
        bs = np.asarray(bs, dtype=np.float64)
        tokens = np.asarray(tokens, dtype=np.float64)
        return self.bias_s + np.interp(bs, self.bs_probes, self.alpha_s) + np.interp(tokens, self.token_probes,
                                                                                    self.theta_s)


_MAX_PROBE = 1 << 31       # batch sizes and tokens
_MAX_VALUE = 1e6          # seconds, or steps per second
_MIN_STEPS_PER_S = 1e-3   # a step of at most 1,000 s (1e-300 would read as 1e300 s)


def _probes(table: dict, probes_key: str, values_key: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    probes, values = table.get(probes_key), table.get(values_key)
    for key, value in ((probes_key, probes), (values_key, values)):
        if not isinstance(value, list):
            raise ValueError(f"{where}: {key!r} is missing or not a list")
    if not probes:
        raise ValueError(f"{where}: {probes_key!r} is empty (the table needs at least one probe)")
    if len(probes) != len(values):
        raise ValueError(f"{where}: {probes_key!r} has {len(probes)} entries, {values_key!r} {len(values)}")
    if not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= _MAX_PROBE for p in probes):
        raise ValueError(f"{where}: {probes_key!r} must hold integers in 0..{_MAX_PROBE}, got {probes[:8]}")
    if any(b <= a for a, b in zip(probes, probes[1:])):
        raise ValueError(f"{where}: {probes_key!r} must be strictly increasing, got {probes[:8]}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               and abs(v) <= _MAX_VALUE for v in values):
        raise ValueError(f"{where}: {values_key!r} must hold finite numbers of at most {_MAX_VALUE:g} in size")
    return np.asarray(probes, dtype=np.float64), np.asarray(values, dtype=np.float64)


def _parse(table, where: str) -> StepProfile:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a JSON object (SGLang's SPS table), got {type(table).__name__}")
    if "bias_seconds" in table:   # SpsAdditiveCostTable (SGLang tells the two apart by this key too)
        bias = table["bias_seconds"]
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias) or bias <= 0:
            raise ValueError(f"{where}: 'bias_seconds' must be a number > 0, got {bias!r}")
        bs_probes, alpha = _probes(table, "bs_probes", "alpha_seconds", where)
        token_probes, theta = _probes(table, "m_probes", "theta_seconds", where)
        total = bias + alpha.min() + theta.min()
        if total <= 0:
            raise ValueError(f"{where}: the table gives a step time <= 0 s ({total:g})")
        return StepProfile(float(bias), bs_probes, alpha, token_probes, theta, where)
    if "sample_batch_tokens" not in table:
        raise ValueError(f"{where}: not an SGLang SPS table (needs 'sample_batch_tokens' and "
                         f"'sample_steps_per_sec', or 'bias_seconds'); keys: {sorted(table)[:8]}")
    tokens, steps_per_s = _probes(table, "sample_batch_tokens", "sample_steps_per_sec", where)
    if tokens[0] < 1:
        raise ValueError(f"{where}: 'sample_batch_tokens' must be >= 1, got {int(tokens[0])}")
    if (steps_per_s < _MIN_STEPS_PER_S).any():
        raise ValueError(f"{where}: 'sample_steps_per_sec' must be at least {_MIN_STEPS_PER_S:g}")
    largest = table.get("max_batch_tokens", int(tokens[-1]))
    if not isinstance(largest, int) or largest < tokens[-1]:
        raise ValueError(f"{where}: 'max_batch_tokens' must be an integer >= the largest probe, got {largest!r}")
    zero = np.zeros(1)
    return StepProfile(0.0, zero, zero, tokens, 1.0 / steps_per_s, where)


def load_step_profile(path: str) -> StepProfile:
    """Read SGLang's SPS table at ``path``; ValueError says what is wrong with a bad file."""
    try:
        text = read_regular(path, (1 << 22) + 1)   # a FIFO is refused, not waited on
    except OSError as err:
        raise ValueError(f"{path}: cannot read the SPS table: {err.strerror or err}") from err
    if len(text) > 1 << 22:
        raise ValueError(f"{path}: larger than 4 MiB, not an SPS table")
    try:
        table = json.loads(text.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{path}: not JSON ({type(err).__name__}: {str(err)[:200]})") from None
    try:
        return _parse(table, path)
    except OverflowError:   # an integer past a float's range
        raise ValueError(f"{path}: a number in the table is out of range") from None
