"""The ragged op: one call over a serving engine's flat batch of requests (spec, reference, api)."""
