"""Self-distillation toward the exact path: the served-vs-exact gap as a training loss.

``dsv41 eval-served`` measures, per response token, KL(exact ‖ served) between two forwards of the *same*
weights: (a) every fake-quant switch off, no replay, no CED; (b) the served path. Response-token CE of the
served path (plain QAT) does not ask for that: it improves the served predictions, and a model can get
better served than exact without getting any closer to its own exact path (docs/posttraining.md). This term
asks for it directly: ``posttrain.distill.weight · KL(teacher ‖ student)`` over the response tokens, with

* **student** = the served forward of the step (fake-quant with straight-through gradients, CED, encoder
  replay at the drawn hit), the logits the response CE already uses;
* **teacher** = the exact forward (``cache_quant`` all off, no replay, no CED) of the **current** weights
  under ``stop_gradient``, in the run's compute dtype (fp32 in ``configs/qat_tiny.yaml``, as the eval's (a)).

Why the current weights and not a frozen copy of the starting ones: the metric compares the model with
itself, and the SFT objective keeps moving the model (response NLL falls by ~0.6 nats over the recipe), so a
frozen teacher would pull the student back toward the starting model's predictions (fighting the CE term)
and would measure a different distance from the one evaluated; it would also have to be carried through the
step and the checkpoints. Why ``stop_gradient``: without it the cheapest way down is to move the exact path
toward the served one (e.g. flatten both distributions), which degrades the model the serving is supposed
to approximate; with it, every update moves the served predictions toward the exact ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def token_kl(teacher: Float[Array, "*B V"], student: Float[Array, "*B V"]) -> Float[Array, "*B"]:
    """KL(softmax(teacher) ‖ softmax(student)) per position, in fp32 (the eval's ``KL(a‖b)``). Its gradient
    with respect to the student logits is ``softmax(student) − softmax(teacher)``."""
    lt = jax.nn.log_softmax(teacher.astype(jnp.float32))
    ls = jax.nn.log_softmax(student.astype(jnp.float32))
    return jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1)
