"""The automatic controller's knobs: one dataclass, and the ``vcap-sidecar`` flags derived from it."""

from dataclasses import MISSING, dataclass, field, fields

__all__ = ["ControllerConfig", "add_controller_arguments", "config_from_args"]


def _flag(name: str, help: str, **extra) -> dict:
    return {"flag": name, "help": help, **extra}


def bucket_edges(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``."""
    return tuple(int(v) for v in str(text).split(",") if v.strip())


@dataclass(slots=True)
class ControllerConfig:
    """Knobs of the automatic controller; those with a ``flag`` are ``vcap-sidecar`` flags."""

    # The guardrail protects goodput against model error: a rule is allowed only where its
    # predicted gain over verifying every row stays positive guardrail_z standard errors down.
    # The operator's explicit bound on accepted drafts given up per request-step (against
    # verifying every row) is off by default: at 0.1 it forbade the rules that win on saturated
    # servers (bench/CONTROLLER_RESULTS.md).
    max_tokens_given_up: float = field(default=float("inf"), metadata=_flag(
        "--max-tokens-given-up",
        "auto mode: most accepted drafts per request-step the policy may give up against verifying "
        "every row; inf: no such bound, only the goodput guardrail (a rule must beat verifying every "
        "row by more than the uncertainty of its estimate)"))
    explore_period: int = field(default=0, metadata=_flag(
        "--explore-period", "auto mode: verify every row every N steps (0: adaptive)"))
    # adaptive exploration: at most this fraction of goodput. 0.25%: on the H200 loop exploration at
    # 0.5% was most of what auto trailed vLLM's rule by; at 0.25% the CPU traces' calibration still
    # tracks every change (bench/CONTROLLER_RESULTS.md, tenth round)
    explore_cost_target: float = field(default=0.0025, metadata=_flag(
        "--explore-cost-target", "auto mode: goodput fraction adaptive exploration may cost"))
    min_explore_period: int = 16
    max_explore_period: int = 400
    min_gain: float = field(default=0.005, metadata=_flag(
        "--controller-min-gain", "auto mode: predicted relative gain that justifies a change"))
    idle_bucket_gain: float = 0.03        # min_gain for buckets without recent load
    # going back to the rule a busy bucket last left, or to any rule on its side of the rule in
    # force (in live rows), at the same load (within 50%) and the same acceptance, needs this much
    # more gain: rules predicted within the gain threshold of each other do not alternate
    return_gain: float = 0.01
    confidence_z: float = 1.0             # a gain must exceed min_gain + z standard errors
    # how much the measured step times' standard error counts in that of a gain (0: only the
    # window's tokens, as before; the engine's step times jitter, a model's do not)
    step_se_weight: float = 1.0
    guardrail_z: float = 2.0              # both guardrails are judged at +- z standard errors
    min_interval_s: float = field(default=3.0, metadata=_flag(
        "--controller-min-interval", "auto mode: seconds between two policy changes"))
    # manual mode: the decision only feeds the readings (metrics, scraped every 15 s); judging every
    # rule on the window at each tick cost an eighth of the sidecar's CPU at the design load
    manual_plan_interval_s: float = 5.0
    bucket_edges: tuple[int, ...] = field(default=(1, 2, 4, 8, 16, 32, 64, 128), metadata=_flag(
        "--controller-buckets", "auto mode: batch-size bucket edges", type=bucket_edges))
    window_rows: int = 16384
    window_max_age_s: float = 60.0       # rows older than this (record clock) are not judged on
    # where under settled_share of the window's rows ran at a busy bucket's load (within 50%), the
    # load moved: the bucket is judged on its rows of the last moved_window_s at its load, once it
    # has bucket_rows of them (EngineModel.evaluate_buckets)
    settled_share: float = 0.75
    moved_window_s: float = 20.0
    # ... as where the first draft's acceptance of its last moved_window_s left that of its older
    # rows by drift_allowance and moved_acceptance_z standard errors, over means of moved_chunk_s
    moved_acceptance_z: float = 2.5
    moved_chunk_s: float = 5.0
    # a rise read so is forgotten as the drift test's alarm where fewer than this share of the
    # last moved_window_s of rows verified a second draft: the rule in force hides the later drafts
    rise_seen_share: float = 0.1
    # ... and by as many of that difference's standard deviations while nothing moved, per request,
    # once it was seen for moved_spread_min_s (decayed over moved_spread_half_life_s)
    moved_spread_half_life_s: float = 600.0
    moved_spread_min_s: float = 60.0
    bucket_rows: int = 1024
    rows_per_record: int = 32
    # the first decision (and the first after a change of acceptance) waits for this many rows;
    # until then the policy in force stays (all-live at a start), and the guardrail's z standard
    # errors keep a decision on few rows cautious
    min_rows: int = 300
    cost_samples: int = 2048
    sample_half_life_s: float = 20.0     # recency weight of expert-count and step-time samples
    calibration_half_life_rows: float = 50_000.0
    # a change of acceptance: CUSUMs over blocks of drift_block_s of record time, one unit per
    # request in a block (calibration.AcceptanceDrift)
    drift_allowance: float = 0.03        # absolute change of acceptance (or confidence) that counts as none
    drift_threshold: float = 10.0        # standard errors, summed over blocks, that raise the alarm
    drift_slack: float = 1.0             # standard errors per block that count as none
    drift_block_s: float = 1.0
    # after a change, a prior-weighted restart of the calibration: positions whose drift
    # statistics moved keep forget_moved_keep of their counts, the others forget_keep, and no
    # position keeps more than forget_max_drafts drafts' worth (2% of a long run is thousands)
    forget_keep: float = 0.02
    forget_moved_keep: float = 0.0
    forget_max_drafts: float = 200.0
    # the first decision after a change of acceptance waits for this many new rows (min_rows at a start)
    relearn_rows: int = 150
    # the steps per batch size a bucket's rule is planned for fade over this half-life: short
    # enough that a draining bucket is judged at the sizes it serves now, not 15 s ago
    load_half_life_s: float = 5.0
    # the model proposes, measurement disposes (measured.py, decision.py): in a busy bucket the
    # model's best rules whose live length no measured rule covers (within trial_spacing) and
    # whose predicted goodput is within trial_margin of the best are run for a short trial
    # (trial_min_steps steps and trial_min_rows request rows), at most trial_max per bucket until
    # the load or the acceptance moves or trial_ttl_s pass, and then up to trial_max more of rules
    # between two measured live lengths where the step time may bend (decision._between_candidates); the
    # choice then uses the measured step times. trial_margin 0: no trials, no measured correction.
    trial_margin: float = field(default=0.05, metadata=_flag(
        "--controller-trial-margin", "auto mode: try a rule whose predicted goodput is within this "
        "fraction of the best for a few steps, and choose on its measured step time (0: never)"))
    trial_max: int = 2
    trial_min_share: float = 0.25      # trials only in a bucket with this share of the engine's time
    trial_steady_s: float = 10.0       # ... whose load has stayed (within 50%) this long
    trial_min_steps: int = 8
    trial_min_rows: int = 512
    trial_spacing: float = 0.25        # live length per request a measured rule covers either side
    # ... and beyond every measured live length, where the correction is held flat, not measured
    # (at 0.25 there, shift-4-96 on the H200 loop never tried the rule below its lowest measured
    # one that won at bs 96, and stayed 1.9-2.2% behind; bench/CONTROLLER_RESULTS.md, round 14)
    trial_edge_spacing: float = 0.05
    # every second trial goes far in live length where verifying every row gives each expert this
    # many (row, expert) pairs on average: a fused-MoE tile (BLOCK_SIZE_M 16). On the H200 loop the
    # linear fit is within 0.1 ms of the measured steps at bs <= 16 and 18 ms off at bs 256
    trial_far_pairs: float = 16.0
    trial_ttl_s: float = 3600.0
    trial_between_s: float = 60.0      # trials between measured live lengths only this long after the load settles
    trial_max_steps: int = 256         # a trial also ends with this many steps (at bs 1 the rows take longer)
    # newest steps kept per bucket and rule. The rule in force is measured without end: with 256
    # steps its measured step time wandered by chance past rules measured once, and a steady load
    # saw a write every minute or two (bench/CONTROLLER_RESULTS.md, fifteenth round)
    step_time_memory: int = 2048
    engine_metrics_url: str | None = field(default=None, metadata=_flag(
        "--engine-metrics", "SGLang's /metrics URL: read sglang:num_queue_reqs for the engine queue",
        type=str, metavar="URL"))
    engine_metrics_interval_s: float = 5.0
    sps_table: str | None = field(default=None, metadata=_flag(
        "--controller-sps-table", "auto mode: the engine's start-up step-time profile, SGLang's DSpark SPS table "
        "(the file of --speculative-dspark-sps-table-path): its shape in verify tokens bends the step cost "
        "between the live lengths the controller measured", type=str, metavar="FILE"))
    prior_recording: str | None = field(default=None, metadata=_flag(
        "--controller-prior", "auto mode: start from this --record file (the last run's telemetry) as "
        "the prior of the calibration, expert curve and step cost, so the first decision comes sooner",
        type=str, metavar="FILE"))

    def __post_init__(self):
        edges = tuple(int(e) for e in self.bucket_edges)
        self.bucket_edges = edges
        checks = [
            (self.max_tokens_given_up >= 0, "max_tokens_given_up must be >= 0"),
            (0 <= self.explore_period <= 1_000_000, "explore_period must be in 0..1000000"),
            (0 < self.explore_cost_target < 1, "explore_cost_target must be in (0, 1)"),
            (1 <= self.min_explore_period <= self.max_explore_period, "need 1 <= min_explore_period <= max_explore_period"),
            (min(self.min_gain, self.idle_bucket_gain, self.return_gain, self.confidence_z, self.guardrail_z,
                 self.moved_acceptance_z, self.step_se_weight) >= 0,
             "gains and z must be >= 0"),
            (self.min_interval_s >= 0, "min_interval_s must be >= 0"),
            (self.manual_plan_interval_s >= 0, "manual_plan_interval_s must be >= 0"),
            (len(edges) >= 1 and edges[0] == 1 and all(a < b for a, b in zip(edges, edges[1:])),
             f"bucket_edges must start at 1 and increase, got {edges}"),
            (self.window_rows >= 64 and self.rows_per_record >= 1 and self.min_rows >= 1, "window sizes must be positive"),
            # as many chunks of the window as the whole window's (goodput.evaluate_rules: 8 of 16 rows)
            (self.bucket_rows >= 128, "bucket_rows must be >= 128"),
            (0 <= self.settled_share <= 1 and 0 <= self.rise_seen_share <= 1,
             "settled_share and rise_seen_share must be in [0, 1]"),
            (self.cost_samples >= 32, "cost_samples must be >= 32"),
            (min(self.window_max_age_s, self.moved_window_s, self.moved_chunk_s, self.sample_half_life_s,
                 self.calibration_half_life_rows, self.moved_spread_half_life_s) > 0 and self.moved_spread_min_s >= 0,
             "ages and half-lives must be > 0, moved_spread_min_s >= 0"),
            (self.drift_allowance >= 0 and self.drift_threshold > 0 and self.drift_slack >= 0
             and self.drift_block_s > 0 and 0 <= self.forget_keep <= 1 and 0 <= self.forget_moved_keep <= 1
             and self.forget_max_drafts >= 0 and self.relearn_rows >= 1,
             "need drift_allowance >= 0, drift_threshold > 0, drift_slack >= 0, drift_block_s > 0, "
             "forget_keep and forget_moved_keep in [0, 1], forget_max_drafts >= 0 and relearn_rows >= 1"),
            (self.load_half_life_s > 0 and self.engine_metrics_interval_s > 0, "intervals must be > 0"),
            (0 <= self.trial_margin < 1 and self.trial_max >= 0 and self.trial_min_steps >= 1
             and self.trial_min_rows >= 1 and self.trial_spacing > 0 and self.trial_edge_spacing > 0
             and self.trial_far_pairs >= 0 and self.trial_ttl_s > 0 and self.trial_between_s >= 0
             and self.step_time_memory >= self.trial_max_steps >= self.trial_min_steps
             and 0 <= self.trial_min_share <= 1
             and self.trial_steady_s >= 0,
             "need trial_margin in [0, 1), trial_max >= 0, trial_min_steps, trial_min_rows >= 1, "
             "trial_far_pairs >= 0, trial_spacing, trial_edge_spacing, trial_ttl_s > 0, trial_between_s >= 0, "
             "step_time_memory >= trial_max_steps >= trial_min_steps, trial_min_share in [0, 1] "
             "and trial_steady_s >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def _flagged():
    return [item for item in fields(ControllerConfig) if "flag" in item.metadata]


def add_controller_arguments(parser) -> None:
    """The controller's ``vcap-sidecar`` flags, with the dataclass's defaults."""
    for item in _flagged():
        meta = dict(item.metadata)
        flag = meta.pop("flag")
        default = item.default if item.default is not MISSING else None
        if isinstance(default, tuple):   # shown and parsed as the flag is written: 1,2,4
            default = ",".join(str(v) for v in default)
        meta.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
        meta["help"] = meta["help"] + " (default: %(default)s)"
        parser.add_argument(flag, dest=item.name, default=default, type=meta.pop("type", type(default)), **meta)


def config_from_args(args) -> ControllerConfig:
    """Raises ValueError on a bad flag value."""
    return ControllerConfig(**{item.name: getattr(args, item.name) for item in _flagged()})
