"""A streamed tune: a checkpoint folder larger than memory, planned one decoder block at a time.

``autoprec tune model.py`` streams when model.py names its checkpoint folder (``MODEL_DIR``, as ``autoprec init
--hf`` writes it) and the whole model would not fit in memory (or ``--stream always``): the model's skeleton is
built on the meta device, and each decoder block is read from the safetensors shards when it is needed and freed
after (:mod:`.checkpoint`); the calibration activations are carried from block to block (:mod:`.blocks`); each
layer's sensitivity is measured on its block's output and carried to the logits by random vector-Jacobian
products, as the depth-linear estimate does (:mod:`.profiling`); the search runs unchanged on that profile with a
predicted fidelity, and the best plans are verified by a streamed forward of the held-out batches (:mod:`.plan`).
:mod:`.run` is the conductor and the memory check that picks the mode.
"""

from __future__ import annotations

__all__: list[str] = []
