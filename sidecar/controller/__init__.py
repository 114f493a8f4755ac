"""The automatic controller (``vcapctl set --mode auto``): learns acceptance, expert cost and
load from the telemetry records and writes the policy of best predicted goodput.

config.py      ControllerConfig and its vcap-sidecar flags
samples.py     what is kept of each batch of records
calibration.py cost_model.py load.py   the models of acceptance, step cost and load
goodput.py     counterfactual goodput of candidate rules on recorded rows
model.py       all of the above for one engine geometry
decision.py    the choice per bucket, the exploration period, the policy written
auto.py        AutoController: observe (link thread), tick (main loop), readings (metrics)
"""

from .auto import CONTROLLER_METRICS, AutoController, ControllerReadings
from .config import ControllerConfig, add_controller_arguments, config_from_args

__all__ = ["AutoController", "ControllerConfig", "ControllerReadings", "CONTROLLER_METRICS",
           "add_controller_arguments", "config_from_args"]
