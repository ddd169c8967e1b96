"""The producer side: planning a dispatch, asking the store, and publishing only what it created.

Also batches, ``send_task``, re-sends of a job under its own id, chord bodies,
and the co-located path where the decision and the publish are one step.
"""
