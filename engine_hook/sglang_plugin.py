"""vcap inside SGLang (verified on 0.5.23): the plugin SGLang loads in every scheduler process.

Enabled by ``VCAP_SEGMENT=<name>`` (``python -m vcap.engine_hook.launch`` sets it); without it
the plugin does nothing. Per verify step, in the order SGLang's DSpark worker runs:

0. ``Scheduler.get_next_batch_to_run``: the length of the scheduler's waiting queue, for the
   record (the propose call site sees only the batch, which holds no reference to its scheduler).
1. ``DraftBlockProposer.propose`` (eager): the draft's confidence -> live lengths on TP rank 0
   (policy from the segment), sent to every rank of the group SGLang's own ``SpecTpSync`` uses
   (one kernel per rank through inboxes mapped over CUDA IPC on one node, :mod:`.tp_share`; an
   eager broadcast across nodes), so every rank routes and cuts with rank 0's lengths.
2. ``DeepseekV4ForCausalLM.forward``: marks target-verify forwards; the first one (a warm-up,
   before graph capture) builds the hook's buffers, sized by SGLang's own rule
   ``max(largest decode graph, max_running_requests)``.
3. ``moe_fused_gate`` in every MoE layer of the verify: vcap's router, which gives dead rows
   id -1 and weight 0 inside the same launch.
4. The accept (``accept_draft_tokens``, and the in-graph ``DsparkVerifyEpilogue._accept``) gets
   the live lengths as its cutoff (the smaller of them and SGLang's own in cap-accept mode),
   so at most ``L - 1`` drafts are accepted.

Modes vcap cannot keep exact are refused before the model loads (:mod:`.sglang_modes`).
5. After the accept: the telemetry record (TP rank 0), with the device-side exactness guard.
"""

import logging
import os

from .patches import Patch, PatchError, apply, sglang_version
from .sglang_hooks import (ENV_DEAD_ROWS, ENV_SEGMENT, ENV_SEGMENT_GROUP, after_accept, after_forward_decode,
                           after_next_batch, after_propose, around_accept_draft_tokens, around_confidence_head,
                           around_epilogue_accept, around_gate, around_model_forward)
from .sglang_modes import before_scheduler_init, refuse_unsupported_environment

__all__ = ["register", "PATCHES", "VERIFIED_ON", "ENV_SEGMENT", "ENV_DEAD_ROWS", "ENV_SEGMENT_GROUP"]

log = logging.getLogger("vcap.engine_hook")
VERIFIED_ON = ("0.5.23",)


_DSPARK = "sglang.srt.speculative.dspark_components"
PATCHES = [
    Patch("sglang.srt.managers.scheduler.Scheduler.__init__", before_scheduler_init, "before",
          ("self", "server_args", "port_args"),
          VERIFIED_ON, "refuse server layouts vcap cannot keep exact, before the model loads"),
    Patch("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run", after_next_batch, "after",
          ("self", "running_batch", "last_batch"),
          VERIFIED_ON, "the waiting queue's length, for the telemetry record"),
    Patch("sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.forward", around_model_forward, "around",
          ("self", "input_ids", "positions", "forward_batch", "input_embeds=None", "pp_proxy_tensors=None"),
          VERIFIED_ON, "mark target-verify forwards; build buffers at the first (warm-up)"),
    Patch("sglang.kernels.ops.moe.moe_fused_gate.moe_fused_gate", around_gate, "around",
          ("scores", "bias", "topk", "scoring_func='sigmoid'", "num_fused_shared_experts=0", "renormalize=True",
           "routed_scaling_factor=1.0", "apply_routed_scaling_factor_on_output=False", "moe_softcapping=0.0",
           "num_expert_group=1", "topk_group=1", "*", "bias_alt=None", "input_ids=None", "bias_alt_token_id=None",
           "num_token_non_padded=None", "renormalize_epsilon=0.0", "packed_out=None", "sqrtsoftplus_log1p=False"),
          VERIFIED_ON, "route verify rows with dead rows given no experts (same launch)"),
    Patch(f"{_DSPARK}.dspark_draft.DraftBlockProposer.propose", after_propose, "after",
          ("self", "*", "batch", "draft_input", "verify_window", "bs", "device", "target_model",
           "sampling_info", "anchor_prepared=False"),
          VERIFIED_ON, "confidence -> live lengths (rank 0) -> every rank"),
    Patch(f"{_DSPARK}.dspark_verify.accept_draft_tokens", around_accept_draft_tokens, "around",
          ("*", "candidates", "target_logits", "draft_block", "sampling_info", "draft_input", "gamma",
           "verify_num_draft_tokens", "cutoff_layout=None", "fused_argmax=False", "block_verification=False",
           "rejection_noise=None"),
          VERIFIED_ON, "cap acceptance at min(L, SGLang's verify length) - 1 (eager and sampling-graph accept)"),
    Patch(f"{_DSPARK}.dspark_verify.DsparkVerifyEpilogue._accept", around_epilogue_accept, "around",
          ("self", "*", "candidates", "logits", "draft_tokens", "seq_lens", "cutoff_verify_lens=None"),
          VERIFIED_ON, "cap acceptance at L - 1 (accept folded into the verify graph)"),
    Patch(f"{_DSPARK}.dspark_verify.TargetVerifyExecutor.accept_and_finalize", after_accept, "after",
          ("self", "*", "folded_accept", "bs", "verify_ids_2d", "target_logits", "draft_block",
           "sampling_info", "draft_input", "layout", "prefix_lens", "draft_tokens",
           "simulate_bonus_sampling_info=None"),
          VERIFIED_ON, "telemetry record and exactness guard (eager and folded accept)"),
    Patch(f"{_DSPARK}.dspark_sampling_accept_graph.DsparkSamplingAcceptGraph.run", after_accept, "after",
          ("self", "*", "bs", "target_logits"),
          VERIFIED_ON, "telemetry record and exactness guard (sampling-accept graph)"),
    Patch("sglang.srt.models.deepseek_v4_dspark.build_dspark_v4_confidence_head", around_confidence_head,
          "around", ("*", "config", "markov_rank"),
          VERIFIED_ON, "build the draft's confidence head in static mode"),
    Patch(f"{_DSPARK}.dspark_worker_v2.DSparkWorkerV2._forward_decode", after_forward_decode, "after",
          ("self", "batch", "on_publish", "grammar_barrier=None", "coordination_plan=None"),
          VERIFIED_ON, "feed sglang:spec_cap_length with the live lengths"),
]


def register() -> None:
    """SGLang's plugin entry point (group ``sglang.srt.plugins``, name ``vcap``).

    SGLang logs and ignores exceptions of plugins, so a refusal leaves through SystemExit:
    a scheduler that cannot run vcap correctly must not start.
    """
    if not os.environ.get(ENV_SEGMENT):
        return
    try:
        refuse_unsupported_environment()
        apply(PATCHES)
    except PatchError as error:
        log.critical("vcap: %s", error)
        raise SystemExit(f"vcap: {error}") from None
    log.info("vcap: %d patches applied on SGLang %s (segment %s)", len(PATCHES), sglang_version(),
             os.environ[ENV_SEGMENT])
