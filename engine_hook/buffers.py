"""The device buffers the step kernels share, and the word layout of each.

- ``staged`` (int32, host to device before each replay): ``STAGED_*``, the step number as the
  int64 at ``STAGED_STEP64``, then from ``STAGED_HEAD`` the control block the step uses.
- ``info`` (int32): this step's decision (``INFO_*``), read by the router and by the next
  step's record.
- ``state`` (int64): what the kernels carry from step to step (``STATE_*``).
- ``pending`` (one record, the segment's layout) and ``pending_status`` (int64: the engine status
  words to publish with it, then ``PENDING_VALID``).

Triton kernels read module globals only as ``tl.constexpr``; each kernel module wraps the
numbers it uses.
"""

import torch

from ._triton import use_asm

__all__ = ["StepBuffers", "STAGED_BS", "STAGED_CONF_PRESENT", "STAGED_EXPLORE", "STAGED_SAMPLED",
           "STAGED_CONTROL", "STAGED_NUM_QUEUED", "STAGED_STEP64", "STAGED_HEAD", "INFO_GENERATION", "INFO_MODE",
           "INFO_FLAGS", "INFO_BS", "INFO_SAMPLED", "INFO_CONTROL", "INFO_NUM_QUEUED", "INFO_WORDS",
           "STATE_HAS_STEP", "STATE_STEP", "STATE_START", "STATE_END", "STATE_GUARD", "STATE_VIOLATIONS",
           "STATE_RECORDS", "PENDING_VALID", "PENDING_WORDS"]

STAGED_BS, STAGED_CONF_PRESENT, STAGED_EXPLORE, STAGED_SAMPLED, STAGED_CONTROL, STAGED_NUM_QUEUED = range(6)
STAGED_STEP64, STAGED_HEAD = 3, 16
INFO_GENERATION, INFO_MODE, INFO_FLAGS, INFO_BS, INFO_SAMPLED, INFO_CONTROL, INFO_NUM_QUEUED = range(7)
INFO_WORDS = 8
STATE_HAS_STEP, STATE_STEP, STATE_START, STATE_END, STATE_GUARD, STATE_VIOLATIONS, STATE_RECORDS = range(7)
STATE_WORDS = 16
PENDING_VALID, PENDING_WORDS = 7, 8


class StepBuffers:
    """Device buffers of the step kernels; they exist before capture and live as long as the graphs.

    ``device_clock`` False: ``clock`` stands in for ``%globaltimer`` (tests fill it).
    """

    def __init__(self, layout, device):
        config = layout.config
        self.layout, self.device = layout, torch.device(device)
        self.max_bs, self.stride = config.max_bs, config.stride
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=self.device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.live = torch.full((config.max_bs,), config.stride, dtype=torch.int32, device=self.device)
        self.info = torch.zeros(INFO_WORDS, dtype=torch.int32, device=self.device)
        self.conf_stash = torch.zeros(config.max_bs * config.num_drafts, dtype=torch.float32, device=self.device)
        self.acc_stash = torch.zeros(config.max_bs, dtype=torch.int32, device=self.device)
        self.conf_missing = torch.zeros((1, config.num_drafts), dtype=torch.float32, device=self.device)
        self.pending = torch.zeros(layout.record_size, dtype=torch.uint8, device=self.device)
        self.pending_status = torch.zeros(PENDING_WORDS, dtype=torch.int64, device=self.device)
        self.device_clock = True

    @property
    def use_timer(self) -> bool:
        return use_asm(self.device) and self.device_clock
