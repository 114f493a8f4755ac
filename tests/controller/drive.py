"""The sidecar's loop around the controller, for tests on the simulated engine (engine time)."""

from vcap.sidecar.telemetry import unpack


def drive(engine, controller, control, seconds: float, on_step=None) -> list:
    """Step ``engine`` until ``seconds`` of engine time, the controller observing every record and
    ticking every 0.5 s as the sidecar does; the engine follows each policy it writes.
    ``on_step(engine)`` runs before each step. Returns ``[(engine seconds, policy written)]``."""
    generation, writes, next_tick = control.generation, [], 0.5
    while engine.engine_time_ns < seconds * 1e9:
        if on_step:
            on_step(engine)
        controller.observe(0, unpack(engine.step()))
        now = engine.engine_time_ns / 1e9
        if now >= next_tick:
            controller.tick(now)
            next_tick = now + 0.5
            if control.generation != generation:
                generation = control.generation
                engine.set_policy(control.policy, generation, "auto")
                writes.append((now, control.policy))
    return writes
