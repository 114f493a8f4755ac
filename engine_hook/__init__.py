"""The in-engine half of vcap: maps the segment into CUDA, computes live lengths, gives dead
verify rows no experts, caps acceptance and publishes telemetry. Modules that need torch import
it themselves, so ``vcap.engine_hook.reference`` and the simulated engine stay torch-free."""

__all__: list[str] = []
