"""Pre-training: run config, train step, Orbax checkpoints, loop (``dsv41 train``)."""
