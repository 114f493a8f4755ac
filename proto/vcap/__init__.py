"""vcap: run-time control of how many drafted tokens a speculative-decoding engine verifies.

This folder holds what both processes share, the two contracts between them:
``vcap.v1`` (the gRPC API, generated from ``vcap/v1/controller.proto``), ``vcap.segment``
(the shared-memory layout, with every offset in its docstring; it re-exports the parts that have
modules of their own: ``vcap.layout``, the header and each region's offset; ``vcap.control``, the
control block and the lease rule; ``vcap.ring``, the telemetry records) and ``vcap.policy`` (the
policy the control block carries).
The sidecar is ``vcap.sidecar``, the in-engine half ``vcap.engine_hook``.
"""

__version__ = "0.1.0"
