"""Orbax checkpoints of a training run: the TrainState (step, params, router biases, optimizer state), the data
iterator state and the run config, every N steps, keep-last-K.

Orbax writes each step into a temporary directory and renames it when complete, so a run killed while saving
leaves the previous good step as the latest one (atomic). Saves are asynchronous: training continues while
arrays are written; :meth:`RunCheckpointer.close` waits for the last one.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp


class RunCheckpointer:
    def __init__(self, directory: str | Path, every: int, keep: int):
        self.dir = Path(directory).absolute() / "checkpoints"
        self.every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.dir, options=options, item_names=("state", "data", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def should_save(self, step: int, last: bool) -> bool:
        return last or (self.every > 0 and step % self.every == 0)

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(json.loads(json.dumps(config, default=str)))))

    def restore(self, step: int, like) -> tuple[object, dict]:
        """The TrainState of ``step`` placed like ``like`` (any mesh: Orbax reshards), and the data state."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
