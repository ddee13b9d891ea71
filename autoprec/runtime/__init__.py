"""The runtime a user ships: the policy file, ``apply_policy``, cast-once weights, the precisions and their kernels
(FP8, MX, torchao's modules), torch.compile around a policy, and what a training loop needs beside it.

Nothing here imports optuna or a later stage: a model with a policy needs this package alone.
"""
